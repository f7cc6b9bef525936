"""POST /v1/chat/completions: render the conversation, run it, answer (or stream) it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_llm import RequestStream
from tokenmill.entrypoints.openai.chat_output import ChatOutputParser, ChatStreamer
from tokenmill.entrypoints.openai.errors import bad_request, from_exception
from tokenmill.entrypoints.openai.preprocess import off_loop, render_chat
from tokenmill.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    answered_tier,
    random_id,
)
from tokenmill.entrypoints.openai.serving_common import (
    SSE_DONE,
    chat_logprobs,
    check_common,
    log_request,
    prompt_logprobs_json,
    raise_if_failed,
    sse,
    to_request_options,
    to_sampling_params,
    unless_disconnected,
)
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.entrypoints.openai.structured import (
    keeps_special_tokens,
    template_kwargs,
    tool_setup,
    with_tool_arguments,
)
from tokenmill.multimodal.inputs import MultiModalInputs
from tokenmill.multimodal.server import chat_media_of, is_media_message, with_media
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class PreparedChat:
    """A chat request turned into engine inputs, and the parser of its output."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    parser: ChatOutputParser
    top_n: int | None
    echo: str
    multimodal: MultiModalInputs | None = None


class ChatHandler:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.state.check_model(req.model, required=True)
        prep = await off_loop(self.state, self.prepare, req, "chatcmpl")
        stream, first = await self.start(prep, req, raw)
        reply = _Reply(
            prep.rid,
            self.state.model_name,
            req,
            prep.top_n,
            prep.echo,
            prep.parser,
            self.state.tokenizer,
        )
        if req.stream:
            return StreamingResponse(reply.stream(first, stream), media_type="text/event-stream")
        return JSONResponse(reply.full(first).model_dump())

    def prepare(self, req: ChatCompletionRequest, id_prefix: str) -> PreparedChat:
        """Render the conversation and build the sampling parameters (raises APIError)."""
        llm = self.state.require_llm()
        req.check_fields()
        check_common(req)
        _check_supported(req)
        tokenizer = self.state.tokenizer
        tools = tool_setup(
            req, self.state.config.tool_call_parser, req.chat_template or self.state.chat_template
        )
        media = chat_media_of(llm.engine, req.messages, req.mm_processor_kwargs)  # image parts
        conversation = [with_tool_arguments(_flatten(i, m)) for i, m in enumerate(media.messages)]
        prompt_ids = render_chat(
            self.state,
            tokenizer,
            conversation,
            request_template=req.chat_template,
            server_template=self.state.template_override,
            prompt_logprobs=req.prompt_logprobs,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=req.tools,
            **template_kwargs(req),
        )
        prompt_ids, multimodal = media.attach(prompt_ids)
        reasoning_cls = llm.engine.structured.reasoning_parser
        reasoning = reasoning_cls.for_prompt(tokenizer, prompt_ids) if reasoning_cls else None
        parser = ChatOutputParser(
            reasoning, tools.parser, max_calls=None if req.parallel_tool_calls else 1
        )
        top_n = _top_logprobs(req)
        params = to_sampling_params(
            req,
            self.state.default_sampling_params(),
            max_tokens=req.max_completion_tokens or req.max_tokens,
            logprobs=top_n,
            prompt_logprobs=req.prompt_logprobs,
            kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=tools.guide,
            keep_special_tokens=keeps_special_tokens(tokenizer, reasoning, tools.parser),
        )
        return PreparedChat(
            random_id(id_prefix),
            params.truncate_prompt(prompt_ids),
            params,
            parser,
            top_n,
            _echo_text(req, conversation),
            multimodal,
        )

    async def start(
        self, prep: PreparedChat, req: ChatCompletionRequest, raw: Request
    ) -> tuple[RequestStream, RequestOutput]:
        """Queue the request; its stream and first output (the final one when not streamed)."""
        llm = self.state.require_llm()
        log_request(self.state.config, prep.rid, prep.prompt_ids, prep.params, self.state.tokenizer)
        add = llm.add_request(
            prep.prompt_ids, prep.params, prep.rid,
            options=with_media(to_request_options(req), prep.multimodal),
        )  # fmt: skip
        stream = await unless_disconnected(raw, add)
        try:
            first = await unless_disconnected(raw, anext(stream))
            raise_if_failed(first)
        except BaseException:
            stream.close()
            raise
        return stream, first


def _check_supported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs"
        )


def _top_logprobs(req: ChatCompletionRequest) -> int | None:
    """Engine ``logprobs``: None (off) or how many alternatives per token (0..20)."""
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


def _flatten(i: int, message: Any) -> Any:
    """Content given as a list of text parts becomes one string (templates expect text)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    if is_media_message(message):  # Qwen-VL's template reads the parts
        return message
    texts = []
    for j, part in enumerate(message["content"]):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"messages[{i}].content[{j}] is of type {kind!r}; only 'text' parts are supported",
                "messages",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{i}].content[{j}] has no 'text' string", "messages")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _echo_text(req: ChatCompletionRequest, conversation: list[Any]) -> str:
    """vLLM's echo: prepend the last message when it is the assistant's (being continued)."""
    last = conversation[-1] if conversation else None
    if req.echo and isinstance(last, dict) and last.get("role") == "assistant":
        return last.get("content") or ""
    return ""


class _Reply:
    """Builds the response or the SSE chunks of one chat request."""

    def __init__(
        self,
        rid: str,
        model: str,
        req: ChatCompletionRequest,
        top_n: int | None,
        echo: str,
        parser: ChatOutputParser,
        tokenizer,
    ) -> None:
        self.parser = parser
        self.tokenizer = tokenizer
        self.rid = rid
        self.model = model
        self.req = req
        self.top_n = top_n
        self.echo = echo
        self.created = int(time.time())

    def _logprobs(self, comp: CompletionOutput):
        if self.top_n is None or comp.logprobs is None:
            return None
        return chat_logprobs(comp.token_ids, comp.logprobs, self.top_n)

    def full(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        reasoning = 0
        for c in out.outputs:
            message = self._message(c)
            if message.reasoning_content:
                reasoning += len(
                    self.tokenizer.encode(message.reasoning_content, add_special_tokens=False)
                )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c),
                    finish_reason=_finish_reason(c.finish_reason, bool(message.tool_calls)),
                    stop_reason=c.stop_reason,
                )
            )
        completion = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            service_tier=answered_tier(self.req.service_tier),
            usage=UsageInfo.of(
                len(out.prompt_token_ids), completion, out.num_cached_tokens, reasoning
            ),
            prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
        )

    def _message(self, comp: CompletionOutput) -> ChatMessage:
        if self.parser.is_plain:
            return ChatMessage(content=self.echo + comp.text)
        parts = self.parser.parse(comp.text, final=True)
        calls = [
            {
                "id": self.parser.tools.new_call_id(),
                "type": "function",  # type: ignore[union-attr]
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in parts.calls
        ]
        content = self.echo + parts.content
        return ChatMessage(
            content=content or (None if calls else ""),
            reasoning_content=parts.reasoning,
            tool_calls=calls or None,
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        opts = self.req.stream_options
        chunk = ChatCompletionChunk(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            service_tier=answered_tier(self.req.service_tier),
        )
        wants_usage = opts is not None and (opts.include_usage or opts.continuous_usage_stats)
        return sse(chunk, exclude=None if wants_usage else {"usage"})

    async def stream(self, first: RequestOutput, stream: RequestStream) -> AsyncIterator[str]:
        opts = self.req.stream_options
        continuous = opts is not None and opts.continuous_usage_stats
        prompt_len, cached = len(first.prompt_token_ids), first.num_cached_tokens
        generated = 0

        def usage() -> UsageInfo | None:
            return UsageInfo.of(prompt_len, generated, cached) if continuous else None

        streamers = [ChatStreamer(self.parser) for _ in range(self.req.n)]
        try:
            for i in range(self.req.n):
                role = DeltaMessage(role="assistant", content=self.echo)
                yield self._chunk([ChatChunkChoice(index=i, delta=role)], usage())
            out = first
            while True:
                raise_if_failed(out)
                for c in out.outputs:
                    generated += len(c.token_ids)
                    streamer = streamers[c.index]
                    parts = streamer.feed(c.text, final=c.finish_reason is not None)
                    if not (parts or c.finish_reason or c.logprobs):
                        continue  # text held back (a stop string or a marker may follow)
                    delta = DeltaMessage(
                        content=parts.content
                        if parts.content or not (parts.reasoning or parts.calls)
                        else None,
                        reasoning_content=parts.reasoning or None,
                        tool_calls=parts.calls or None,
                    )
                    finish = _finish_reason(c.finish_reason, bool(streamer.call_ids))
                    choice = ChatChunkChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=self._logprobs(c),
                        finish_reason=finish,
                        stop_reason=c.stop_reason,
                    )
                    yield self._chunk([choice], usage())
                if out.finished:
                    break
                out = await anext(stream)
            if opts is not None and opts.include_usage:
                yield self._chunk([], UsageInfo.of(prompt_len, generated, cached))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-stream
            yield sse(from_exception(exc).body())
        finally:
            stream.close()
        yield SSE_DONE


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A response that ends in tool calls says so (unless it was cut short)."""
    return "tool_calls" if has_calls and reason == "stop" else reason
