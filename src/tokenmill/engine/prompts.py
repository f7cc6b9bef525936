"""User prompt forms -> (text or None, token ids), at the boundary."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeGuard

from tokenmill.engine.request import RequestOptions
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer

PromptInput = str | dict | list


def _is_token_list(x: object) -> TypeGuard[list[int]]:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def normalize_prompts(
    prompts: PromptInput, tokenizer: Tokenizer
) -> list[tuple[str | None, list[int]]]:
    """Accept a string, a token-id list, a {"prompt" | "prompt_token_ids"} dict, or a list of them."""
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise InvalidRequestError(
            "prompts must be a string, a list of token ids, a dict, or a non-empty list of those"
        )
    return [_one(p, tokenizer) for p in prompts]


_OPTION_KEYS = ("cache_salt", "reuse_context", "cache_generated_tokens")


def request_options(
    prompts: PromptInput, priority: int | Sequence[int] | None = None
) -> list[RequestOptions]:
    """Per-prompt engine options: dict prompts may carry cache_salt, reuse_context and
    cache_generated_tokens; ``priority`` is one int or one per prompt (vLLM's argument)."""
    items = (
        [prompts] if isinstance(prompts, (str, dict)) or _is_token_list(prompts) else list(prompts)
    )
    if priority is None or isinstance(priority, int):
        priorities = [priority or 0] * len(items)
    else:
        priorities = list(priority)
        if len(priorities) != len(items):
            raise InvalidRequestError(f"got {len(priorities)} priorities for {len(items)} prompts")
    return [
        RequestOptions(
            priority=prio,
            **({k: p[k] for k in _OPTION_KEYS if k in p} if isinstance(p, dict) else {}),
        )
        for p, prio in zip(items, priorities)
    ]


def _one(p: object, tokenizer: Tokenizer) -> tuple[str | None, list[int]]:
    if isinstance(p, str):
        return p, tokenizer.encode(p)
    if _is_token_list(p):
        return None, list(p)
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            ids = p["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise InvalidRequestError("prompt_token_ids must be a list of integers")
            return p.get("prompt"), list(ids)
        if isinstance(p.get("prompt"), str):
            return p["prompt"], tokenizer.encode(p["prompt"])
    if isinstance(p, list) and not p:
        raise InvalidRequestError("the prompt is empty; give at least one token")
    raise InvalidRequestError(
        f"unsupported prompt {type(p).__name__}: use a string, a list of token ids, "
        'or a dict with "prompt" or "prompt_token_ids"'
    )


def params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None,
    n: int,
    default: Callable[[], SamplingParams],
) -> list[SamplingParams]:
    if params is None:
        return [default()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(
            f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt"
        )
    return params
