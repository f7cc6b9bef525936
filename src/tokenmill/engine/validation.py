"""Checks at the engine boundary: each bad input is a ValueError saying what to change."""

from __future__ import annotations

from tokenmill.errors import ContextLengthError, InvalidRequestError
from tokenmill.sampling_params import SamplingParams


def check_prompt(prompt_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty; give at least one token")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}"
        )
    if len(prompt_ids) >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {len(prompt_ids)} tokens but max_model_len is {max_model_len}: "
            f"shorten the prompt to at most {max_model_len - 1} tokens or raise max_model_len"
        )


def resolve_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    room = max_model_len - prompt_len
    if params.min_tokens > room:
        raise ContextLengthError(
            f"min_tokens={params.min_tokens} exceeds max_model_len - prompt_len = "
            f"{max_model_len} - {prompt_len} = {room}: the request could never finish as asked"
        )
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise ContextLengthError(
            f"max_tokens={params.max_tokens} exceeds max_model_len - prompt_len = "
            f"{max_model_len} - {prompt_len} = {room}: lower max_tokens or shorten the prompt"
        )
    return params.max_tokens


def check_params(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    params.verify_for_vocab(vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise InvalidRequestError(
                f"{name}={value} is more than max_logprobs={max_logprobs}; ask for fewer"
            )
