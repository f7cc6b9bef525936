"""Turning a request body into token ids without blocking the event loop.

Chat templating and tokenization run on a small thread pool (``preprocess_workers``)
so that ``/health`` and every other client keep being answered while one large
request is prepared. Before any of that work, cheap checks refuse what can not be
served:

- invalid Unicode (a lone surrogate such as ``"\\ud800"``): a 400 naming the field;
- a prompt longer, in characters, than ``max_model_len`` times the longest token of
  the vocabulary can never fit in ``max_model_len`` tokens: refused without
  tokenizing (and without rendering the template);
- a completions request with more prompts than ``max_prompts_per_request``;
- ``prompt_logprobs`` whose cost (prompt tokens x (prompt_logprobs + 1)) is over
  ``max_prompt_logprobs_cost``;
- a request's own ``chat_template`` unless the server trusts them; a trusted one is
  rendered with a time and size limit (``template_guard.py``).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.template_guard import render_untrusted, template_context
from tokenmill.errors import ContextLengthError
from tokenmill.threads import then_release

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.state import ServerState
    from tokenmill.tokenizer import Tokenizer

T = TypeVar("T")

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_longest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pool(workers: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(
                workers, thread_name_prefix="tokenmill-prep"
            )
        return pool


async def off_loop(state: ServerState, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the preprocessing pool; the event loop stays free. The
    pool's thread lets go of OpenMP threads it started (``tokenmill.threads``): the engine
    thread computes."""
    loop = asyncio.get_running_loop()
    pool = _pool(state.config.limits.preprocess_workers)
    return await loop.run_in_executor(pool, functools.partial(then_release, fn, *args, **kwargs))


# -- cheap checks ----------------------------------------------------------------------------
def check_unicode(value: Any, where: str) -> int:
    """Raise a 400 for a string that is not valid Unicode (lone surrogates); returns the
    total characters of the strings in ``value`` (walked without recursion)."""
    total = 0
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            total += len(item)
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(
                    f"{path} is not valid Unicode: {e.reason} at character "
                    f"{e.start} ({item[e.start]!r}); send UTF-8 text",
                    where.split("[")[0],
                ) from None
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    return total


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """Characters of the vocabulary's longest token (its raw spelling; a byte-level token
    spells each byte as one character, so no token covers more characters than this)."""
    longest = _longest.get(tokenizer)
    if longest is None:
        vocab = tokenizer.hf.get_vocab()
        longest = _longest[tokenizer] = max((len(t) for t in vocab), default=1)
    return longest


def check_fits(chars: int, tokenizer: Tokenizer, max_model_len: int, what: str) -> None:
    """A text of ``chars`` characters needs at least chars / longest-token tokens."""
    longest = longest_token_chars(tokenizer)
    if chars > max_model_len * longest:
        raise ContextLengthError(
            f"the {what} has {chars} characters: at least {-(-chars // longest)} tokens "
            f"(no token is longer than {longest} characters), over max_model_len="
            f"{max_model_len}"
        )


def check_prompt_logprobs(state: ServerState, prompt_len: int, prompt_logprobs: int | None) -> None:
    if prompt_logprobs is None:
        return
    cost = prompt_len * (prompt_logprobs + 1)
    cap = state.config.limits.max_prompt_logprobs_cost
    if cost > cap:
        raise bad_request(
            f"prompt_logprobs={prompt_logprobs} over a {prompt_len}-token prompt costs "
            f"{cost} (prompt tokens x (prompt_logprobs + 1)), over the server's limit of "
            f"{cap} (--max-prompt-logprobs-cost); ask fewer or a shorter prompt",
            "prompt_logprobs",
        )


def check_tool_schemas(state: ServerState, tools: list | None) -> None:
    """Every tool's ``parameters`` is a JSON schema the grammar backend accepts, under any
    tool_choice (``required`` compiles it; ``auto`` would otherwise take a broken one)."""
    from tokenmill.structured_output import StructuredOutputsParams

    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        params = function.get("parameters") if isinstance(function, dict) else None
        if params is None:
            continue
        where = f"tools[{i}].function.parameters"
        if not isinstance(params, dict):
            raise bad_request(
                f"{where} must be a JSON schema object, got {type(params).__name__}", "tools"
            )
        try:
            state.require_llm().engine.structured.validate(StructuredOutputsParams(json=params))
        except ValueError as e:
            raise bad_request(f"{where} is not a usable JSON schema: {e}", "tools") from None


# -- chat ------------------------------------------------------------------------------------
def render_chat(
    state: ServerState,
    tokenizer: Tokenizer,
    conversation: list[Any],
    *,
    request_template: str | None,
    server_template: str | None,
    prompt_logprobs: int | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list | None,
    **template_kwargs: Any,
) -> list[int]:
    """The conversation's prompt ids (blocking: call it off the event loop, ``off_loop``).

    Cheap checks first (Unicode, a conversation too long to fit, an untrusted request
    template), then the model's or server's template, or the request's one rendered with
    ``template_guard``'s limits."""
    limits = state.config.limits
    chars = check_unicode(conversation, "messages") + check_unicode(tools, "tools")
    max_len = state.max_model_len
    check_fits(chars, tokenizer, max_len, "conversation")
    check_tool_schemas(state, tools)
    if request_template is None:
        ids = tokenizer.apply_chat_template(
            conversation,
            chat_template=server_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            **template_kwargs,
        )
    elif not limits.trust_request_chat_template:
        raise bad_request(
            "this server does not render chat templates sent in requests; "
            "leave chat_template out (the model's template is used), or start "
            "the server with --trust-request-chat-template",
            "chat_template",
        )
    else:
        check_unicode(request_template, "chat_template")
        ids = _render_request_template(
            state,
            tokenizer,
            conversation,
            request_template,
            add_generation_prompt,
            continue_final_message,
            tools,
            template_kwargs,
        )
    check_prompt_logprobs(state, len(ids), prompt_logprobs)
    return ids


def _render_request_template(
    state: ServerState,
    tokenizer: Tokenizer,
    conversation: list[Any],
    template: str,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list | None,
    template_kwargs: dict[str, Any],
) -> list[int]:
    max_len = state.max_model_len
    context = template_context(
        tokenizer, conversation, tools, add_generation_prompt, **template_kwargs
    )
    text = render_untrusted(
        template,
        context,
        state.config.limits.chat_template_timeout,
        max_len * longest_token_chars(tokenizer),
    )
    final = (
        conversation[-1].get("content")
        if conversation and isinstance(conversation[-1], dict)
        else None
    )
    if continue_final_message and isinstance(final, str) and final and final in text:
        text = text[: text.rindex(final) + len(final)]
    check_fits(len(text), tokenizer, max_len, "rendered conversation")
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:1] != [bos] and tokenizer.encode("a")[:1] == [bos]:
        ids.insert(0, bos)
    return ids


# -- completions -----------------------------------------------------------------------------
def check_prompts(state: ServerState, prompt: Any) -> None:
    """A completions ``prompt``: how many, valid Unicode, none too long to fit (cheap)."""
    limits = state.config.limits
    items = (
        prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        else [prompt]
    )
    if len(items) > limits.max_prompts_per_request:
        raise bad_request(
            f"the request has {len(items)} prompts, over the server's limit of "
            f"{limits.max_prompts_per_request} (--max-prompts-per-request); "
            "send them in several requests",
            "prompt",
        )
    tokenizer = state.tokenizer
    for i, item in enumerate(items):
        if isinstance(item, str):
            where = f"prompt[{i}]" if len(items) > 1 else "prompt"
            check_unicode(item, where)
            check_fits(len(item), tokenizer, state.max_model_len, where)


async def prepare_prompts(
    state: ServerState,
    prompt: Any,
    prompt_logprobs: int | None,
    tokenize: Callable[[], list[tuple[str, list[int]]]],
) -> list[tuple[str, list[int]]]:
    """``check_prompts``, then ``tokenize()`` off the event loop; then each prompt's
    prompt_logprobs cost."""
    check_prompts(state, prompt)
    prompts = await off_loop(state, tokenize)
    for _, ids in prompts:
        check_prompt_logprobs(state, len(ids), prompt_logprobs)
    return prompts
