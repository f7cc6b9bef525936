"""What chat and text completions share: sampling fields -> ``SamplingParams``, logprob
formats, SSE framing, merging streams, and abandoning work when the client leaves."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from tokenmill.engine.async_llm import RequestStream
from tokenmill.engine.request import RequestOptions
from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    SamplingRequest,
    TokenLogprob,
    TopLogprob,
)
from tokenmill.outputs import Logprob, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.structured_output import StructuredOutputsParams

T = TypeVar("T")
request_logger = logging.getLogger("tokenmill.requests")

LOGPROB_FLOOR = -9999.0
"""JSON has no -inf: logprobs below this are reported as this (vLLM does the same)."""
SSE_DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected; its request was aborted."""


def sse(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    import json

    return f"data: {json.dumps(payload)}\n\n"


def to_sampling_params(
    req: SamplingRequest,
    default: SamplingParams,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    kind: RequestOutputKind,
    structured_outputs: StructuredOutputsParams | None = None,
    keep_special_tokens: bool = False,
) -> SamplingParams:
    """The request's sampling fields; unset ones come from the model's generation_config.

    ``keep_special_tokens``: the text must keep special tokens (a parser's markers).
    """
    return SamplingParams(
        n=req.n,
        temperature=_pick(req.temperature, default.temperature),
        top_p=_pick(req.top_p, default.top_p),
        top_k=_pick(req.top_k, default.top_k),
        min_p=_pick(req.min_p, default.min_p),
        repetition_penalty=_pick(req.repetition_penalty, default.repetition_penalty),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens and not keep_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logit_bias=req.logit_bias,
        output_kind=kind,
        structured_outputs=structured_outputs,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        disable_spec_decode=getattr(req, "disable_spec_decode", False),
    )


def log_request(
    config, rid: str, prompt_ids: Sequence[int], params: SamplingParams, tokenizer
) -> None:
    """--enable-log-requests: one INFO line per request (prompt cut to --max-log-len)."""
    if not config.log_requests:
        return
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    if config.max_log_len is not None:
        text = text[: config.max_log_len]
    request_logger.info("request %s: %d prompt tokens %r, %s", rid, len(prompt_ids), text, params)


def to_request_options(req: SamplingRequest) -> RequestOptions:
    return RequestOptions(priority=req.priority, cache_salt=req.cache_salt)


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value


MAX_N = 128
"""Most choices one request may ask for (OpenAI's limit): one client can not fill the
engine's queue with a single request."""


def check_common(req: SamplingRequest) -> None:
    """Refuse what the stream options need but the request does not set, and too large n."""
    if req.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


def raise_if_failed(out: RequestOutput) -> None:
    if out.error is not None:
        raise APIError(
            500,
            f"the engine failed on this request: {out.error}",
            type="server_error",
            code="engine_error",
        )


# -- logprobs ---------------------------------------------------------------------------
def _value(lp: Logprob) -> float:
    return LOGPROB_FLOOR if math.isnan(lp.logprob) else max(lp.logprob, LOGPROB_FLOOR)


def _top(pos: PositionLogprobs, n: int) -> list[Logprob]:
    ranked = [lp for lp in pos.values() if lp.rank is not None and lp.rank <= n]
    return sorted(ranked, key=lambda lp: lp.rank or 0)


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int
) -> ChatLogprobs:
    content = []
    for tid, pos in zip(token_ids, positions):
        chosen = pos[tid]
        tops = [
            TopLogprob(
                token=lp.decoded_token or "", logprob=_value(lp), bytes=list(lp.bytes or b"")
            )
            for lp in _top(pos, top_n)
        ]
        content.append(
            TokenLogprob(
                token=chosen.decoded_token or "",
                logprob=_value(chosen),
                bytes=list(chosen.bytes or b""),
                top_logprobs=tops,
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    top_n: int,
    tokenizer,
    offset: int = 0,
) -> CompletionLogprobs:
    """Text-completion format; a None position (the first prompt token) has no logprob."""
    out = CompletionLogprobs()
    for tid, pos in zip(token_ids, positions):
        if pos is None:
            token = tokenizer.decode([tid], skip_special_tokens=False)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            token = pos[tid].decoded_token or ""
            out.token_logprobs.append(_value(pos[tid]))
            out.top_logprobs.append({lp.decoded_token or "": _value(lp) for lp in _top(pos, top_n)})
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
    return out


# -- streams and disconnects ------------------------------------------------------------
async def watch_disconnect(request: Request) -> None:
    """Return when the client closed the connection (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client leaves first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - it was cancelled on purpose
        pass
    raise ClientGone()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; closing aborts them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, done))
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


def prompt_logprobs_json(positions: Sequence[PositionLogprobs | None] | None):
    """vLLM's prompt_logprobs field: [None, {"<token id>": {logprob, rank, decoded_token}}, ...]."""
    if positions is None:
        return None
    return [
        None
        if pos is None
        else {
            str(tid): PromptLogprob(
                logprob=_value(lp), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for tid, lp in pos.items()
        }
        for pos in positions
    ]
