"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): a request runs as
a chat request (``ChatHandler``); the parsed answer becomes thinking / text / tool_use
blocks, streamed as Anthropic's events. Every error leaves as an Anthropic error body."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from tokenmill.engine.async_llm import RequestStream
from tokenmill.entrypoints.openai.chat_output import ChatStreamer, DeltaParts
from tokenmill.entrypoints.openai.errors import bad_request, from_exception
from tokenmill.entrypoints.openai.preprocess import off_loop
from tokenmill.entrypoints.openai.protocol_messages import (
    CountTokensRequest,
    MessageObject,
    MessagesRequest,
    anthropic_error,
    block_id,
    stop_reason,
    to_chat_request,
    tool_input,
    usage,
)
from tokenmill.entrypoints.openai.serving_chat import ChatHandler, PreparedChat
from tokenmill.entrypoints.openai.serving_common import ClientGone, raise_if_failed
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.outputs import RequestOutput


async def _body(raw: Request, model: type[CountTokensRequest]):
    """The request body as ``model``; a missing or wrong field is an Anthropic 400."""
    try:
        data = await raw.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        kind = "Field required" if err.get("type") == "missing" else err.get("msg", "")
        raise bad_request(f"{where}: {kind}", where or None) from exc


class MessagesHandler:
    def __init__(self, state: ServerState, chat: ChatHandler) -> None:
        self.state = state
        self.chat = chat

    async def create(self, raw: Request) -> Response:
        try:
            return await self._create(raw)
        except ClientGone:
            raise
        except Exception as exc:  # noqa: BLE001 - every error in Anthropic's format
            return anthropic_error(from_exception(exc))

    async def count_tokens(self, raw: Request) -> Response:
        try:
            req = await _body(raw, CountTokensRequest)
            self.state.check_model(req.model, required=True)
            chat_req = to_chat_request(req)
            prep = await off_loop(self.state, self.chat.prepare, chat_req, "msg")
            return JSONResponse({"input_tokens": len(prep.prompt_ids)})
        except Exception as exc:  # noqa: BLE001
            return anthropic_error(from_exception(exc))

    async def _create(self, raw: Request) -> Response:
        req = await _body(raw, MessagesRequest)
        self.state.check_model(req.model, required=True)
        if req.max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
        chat_req = to_chat_request(req)
        prep = await off_loop(self.state, self.chat.prepare, chat_req, "msg")
        stream, first = await self.chat.start(prep, chat_req, raw)
        msg = MessageObject(id=block_id("msg"), model=self.state.model_name)
        if req.stream:
            run = _Run(msg, prep, stream)
            return StreamingResponse(run.events(first), media_type="text/event-stream")
        comp = first.outputs[0]
        parts = prep.parser.parse(comp.text, final=True)
        if parts.reasoning:
            msg.content.append({"type": "thinking", "thinking": parts.reasoning, "signature": ""})
        if parts.content or not parts.calls:
            msg.content.append({"type": "text", "text": parts.content})
        for call in parts.calls:
            msg.content.append(
                {
                    "type": "tool_use",
                    "id": block_id("toolu"),
                    "name": call.name,
                    "input": tool_input(call.arguments),
                }
            )
        msg.stop_reason, msg.stop_sequence = stop_reason(
            comp.finish_reason, comp.stop_reason, bool(parts.calls)
        )
        cached = first.num_cached_tokens
        msg.usage = usage(len(first.prompt_token_ids) - cached, len(comp.token_ids), cached)
        return JSONResponse(msg.model_dump())


class _Run:
    """One streamed message: engine deltas -> Anthropic's stream events."""

    def __init__(self, msg: MessageObject, prep: PreparedChat, stream: RequestStream) -> None:
        self.msg, self.prep, self.stream = msg, prep, stream
        self.index = -1
        self.open: str | None = None  # the kind of the block being streamed
        self.has_calls = False

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    async def events(self, first: RequestOutput) -> AsyncIterator[str]:
        cached = first.num_cached_tokens
        prompt = len(first.prompt_token_ids) - cached
        generated = 0
        self.msg.usage = usage(prompt, 0, cached)
        streamer = ChatStreamer(self.prep.parser)
        out: RequestOutput | None = first
        last = first
        try:
            yield self._event("message_start", message=self.msg.model_dump())
            while out is not None:
                raise_if_failed(out)
                last = out
                comp = out.outputs[0]
                generated += len(comp.token_ids)
                for event in self._feed(
                    streamer.feed(comp.text, final=comp.finish_reason is not None)
                ):
                    yield event
                out = None if out.finished else await anext(self.stream, None)
            if self.index < 0:
                for event in self._start({"type": "text", "text": ""}, "text"):
                    yield event
            for event in self._stop():
                yield event
            comp = last.outputs[0]
            reason, sequence = stop_reason(comp.finish_reason, comp.stop_reason, self.has_calls)
            yield self._event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage={"output_tokens": generated},
            )
            yield self._event("message_stop")
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-stream
            error = from_exception(exc)
            body = json.loads(anthropic_error(error).body)
            yield f"event: error\ndata: {json.dumps(body)}\n\n"
        finally:
            self.stream.close()

    def _feed(self, delta: DeltaParts) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            events += self._start({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            events += self._start({"type": "text", "text": ""}, "text")
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.calls:
            fn = call["function"]
            if "id" in call:
                self.has_calls = True
                events += self._stop()
                events += self._start(
                    {"type": "tool_use", "id": block_id("toolu"), "name": fn["name"], "input": {}},
                    "tool_use",
                    new=True,
                )
            if fn.get("arguments"):
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
                )
        return events

    def _start(self, block: dict[str, Any], kind: str, new: bool = False) -> list[str]:
        if self.open == kind and not new:
            return []
        events = self._stop()
        self.index += 1
        self.open = kind
        return events + [self._event("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return self._event("content_block_delta", index=self.index, delta=delta)

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.index)]
