"""POST /v1/completions: one engine request per prompt (a string, strings, token ids)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_llm import RequestStream
from tokenmill.entrypoints.openai.errors import bad_request, from_exception
from tokenmill.entrypoints.openai.preprocess import prepare_prompts
from tokenmill.entrypoints.openai.protocol import (
    CompletionChoiceFull,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    answered_tier,
    random_id,
)
from tokenmill.entrypoints.openai.serving_common import (
    SSE_DONE,
    check_common,
    completion_logprobs,
    log_request,
    merge_streams,
    prompt_logprobs_json,
    raise_if_failed,
    sse,
    to_request_options,
    to_sampling_params,
    unless_disconnected,
)
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.entrypoints.openai.structured import guide_of
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind

Prompt = tuple[str, list[int]]
"""(text to echo, token ids)."""


class CompletionHandler:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        llm = self.state.require_llm()
        self.state.check_model(req.model, required=True)
        req.check_fields()
        check_common(req)
        if req.suffix is not None:
            raise bad_request("suffix (insertion) is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(
                f"best_of={req.best_of} is not supported; leave it unset or equal to n={req.n}",
                "best_of",
            )
        prompt_lp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # echoed tokens need their logprobs too
            prompt_lp = max(prompt_lp or 0, req.logprobs)
        prompts = await prepare_prompts(
            self.state, req.prompt, prompt_lp, lambda: self._prompts(req)
        )
        params = to_sampling_params(
            req,
            self.state.default_sampling_params(),
            max_tokens=1 if _scores_only(req) else req.max_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=prompt_lp,
            kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=guide_of(req),
        )
        prompts = [(text, params.truncate_prompt(ids)) for text, ids in prompts]
        rid = random_id("cmpl")
        streams: list[RequestStream] = []
        merged = None
        try:
            options = to_request_options(req)
            for i, (text, ids) in enumerate(prompts):
                log_request(self.state.config, f"{rid}-{i}", ids, params, self.state.tokenizer)
                add = llm.add_request(ids, params, f"{rid}-{i}", prompt=text, options=options)
                streams.append(await unless_disconnected(raw, add))
            reply = _Reply(rid, self.state.model_name, req, prompts, self.state.tokenizer)
            if req.stream:
                merged = merge_streams(streams)
                first = await unless_disconnected(raw, anext(merged))
                raise_if_failed(first[1])
                return StreamingResponse(
                    reply.stream(first, merged), media_type="text/event-stream"
                )
            finals = [await unless_disconnected(raw, anext(s)) for s in streams]
        except BaseException:
            if merged is not None:
                await merged.aclose()
            for s in streams:
                s.close()
            raise
        for out in finals:
            raise_if_failed(out)
        return JSONResponse(reply.full(finals).model_dump())

    def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        tok = self.state.tokenizer
        if isinstance(p, str):
            p = [p]
        if not p:
            raise bad_request(
                "prompt is empty; send a string, a list of strings or token ids", "prompt"
            )
        if isinstance(p[0], int):
            p = [p]  # one token-id prompt
        out: list[Prompt] = []
        for item in p:
            if isinstance(item, str):
                out.append((item, tok.encode(item, add_special_tokens=req.add_special_tokens)))
            else:
                ids = list(item)
                out.append((tok.decode(ids, skip_special_tokens=False) if req.echo else "", ids))
        return out


def _scores_only(req: CompletionRequest) -> bool:
    """echo with max_tokens=0 (vLLM's, for scoring a prompt): the prompt and its logprobs,
    no new text. The engine samples one token, which is left out."""
    return req.echo and req.max_tokens == 0


class _Reply:
    """Builds the response or the SSE chunks of one completion request."""

    def __init__(
        self, rid: str, model: str, req: CompletionRequest, prompts: list[Prompt], tokenizer
    ) -> None:
        self.rid = rid
        self.model = model
        self.req = req
        self.prompts = prompts
        self.tok = tokenizer
        self.created = int(time.time())
        self.scores_only = _scores_only(req)

    def _index(self, prompt_index: int, comp: CompletionOutput) -> int:
        return prompt_index * self.req.n + comp.index

    def _logprobs(self, comp: CompletionOutput, prompt_out: RequestOutput | None, offset: int):
        """Logprobs of the new tokens, preceded by the prompt's when echoing (prompt_out)."""
        n = self.req.logprobs
        if n is None:
            return None
        ids, positions = list(comp.token_ids), list(comp.logprobs or [])
        if self.scores_only:
            ids, positions = [], []
        if prompt_out is not None:
            prompt_ids = list(prompt_out.prompt_token_ids)
            prompt_pos = list(prompt_out.prompt_logprobs or [])  # None for a 1-token prompt
            prompt_pos += [None] * (len(prompt_ids) - len(prompt_pos))
            ids, positions = prompt_ids + ids, prompt_pos + positions
        return completion_logprobs(ids, positions, n, self.tok, offset)

    def full(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(finals):
            echo = self.prompts[i][0] if self.req.echo else ""
            for c in out.outputs:
                choices.append(
                    CompletionChoiceFull(
                        index=self._index(i, c),
                        text=echo + self._text(c),
                        logprobs=self._logprobs(c, out if self.req.echo else None, 0),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
                    )
                )
        return CompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._usage(finals),
            service_tier=answered_tier(self.req.service_tier),
        )

    def _text(self, comp: CompletionOutput) -> str:
        return "" if self.scores_only else comp.text

    def _usage(self, finals: list[RequestOutput]) -> UsageInfo:
        completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
        completion = 0 if self.scores_only else completion
        cached = sum(out.num_cached_tokens for out in finals)
        return UsageInfo.of(sum(len(ids) for _, ids in self.prompts), completion, cached)

    def _chunk(self, choices: list[CompletionChoiceFull], usage: UsageInfo | None) -> str:
        opts = self.req.stream_options
        chunk = CompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            service_tier=answered_tier(self.req.service_tier),
        )
        wants_usage = opts is not None and (opts.include_usage or opts.continuous_usage_stats)
        return sse(
            chunk,
            exclude={
                "choices": {"__all__": {"prompt_logprobs"}},
                **({} if wants_usage else {"usage": True}),
            },
        )

    async def stream(
        self, first: tuple[int, RequestOutput], merged: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        opts = self.req.stream_options
        continuous = opts is not None and opts.continuous_usage_stats
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        generated = 0
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        echoed: set[int] = set()
        try:
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                i, out = item
                raise_if_failed(out)
                for c in out.outputs:
                    generated += 0 if self.scores_only else len(c.token_ids)
                    index = self._index(i, c)
                    echo = self.req.echo and index not in echoed
                    text = (self.prompts[i][0] if echo else "") + self._text(c)
                    if not (text or c.finish_reason or c.logprobs):
                        continue
                    echoed.add(index)
                    lp = self._logprobs(c, out if echo else None, offsets.get(index, 0))
                    if lp is not None and lp.tokens:
                        offsets[index] = lp.text_offset[-1] + len(lp.tokens[-1])
                    usage = UsageInfo.of(prompt_tokens, generated) if continuous else None
                    choice = CompletionChoiceFull(
                        index=index,
                        text=text,
                        logprobs=lp,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    yield self._chunk([choice], usage)
                item = await anext(merged, None)
            if opts is not None and opts.include_usage:
                yield self._chunk([], UsageInfo.of(prompt_tokens, generated))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-stream
            yield sse(from_exception(exc).body())
        finally:
            await merged.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE
