"""/v1/responses: a Responses API request runs as a chat request (``ChatHandler``), its
parsed answer becomes output items; streamed as the documented event sequence; kept in
a bounded in-memory store for GET, input_items and ``previous_response_id``."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_llm import RequestStream
from tokenmill.entrypoints.openai.chat_output import ChatStreamer, DeltaParts
from tokenmill.entrypoints.openai.errors import APIError, bad_request, from_exception
from tokenmill.entrypoints.openai.preprocess import off_loop
from tokenmill.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    check_request,
    input_items,
    item_id,
    to_chat_request,
    to_messages,
    wants_summary,
)
from tokenmill.entrypoints.openai.responses_output import (
    ResponseObject,
    call_item,
    finish,
    message_item,
    output_text,
    reasoning_item,
    usage,
)
from tokenmill.entrypoints.openai.serving_chat import ChatHandler, PreparedChat
from tokenmill.entrypoints.openai.serving_common import chat_logprobs, raise_if_failed
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.parsers.tools import ToolCall


@dataclass
class Stored:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    """The conversation that a follow-up (previous_response_id) continues."""
    stored_at: float


class ResponseStore:
    """At most ``max_entries`` responses (the oldest go first), none older than ``max_age``
    seconds; in memory only, lost when the server stops."""

    def __init__(self, max_entries: int, max_age: float) -> None:
        self.max_entries = max_entries
        self.max_age = max_age
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, stored: Stored) -> None:
        self._items[rid] = stored
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        now = time.monotonic()
        while self._items:
            oldest = next(iter(self._items.values()))
            if now - oldest.stored_at <= self.max_age:
                break
            self._items.popitem(last=False)
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None


def _not_found(rid: str) -> APIError:
    return APIError(
        404,
        f"no response with id {rid!r} (unknown, deleted, stored with "
        "store=false, or expired from this server's in-memory store)",
        param="response_id",
        code="response_not_found",
    )


class ResponsesHandler:
    def __init__(self, state: ServerState, chat: ChatHandler) -> None:
        self.state = state
        self.chat = chat
        self.store = ResponseStore(
            state.config.responses_store_size, state.config.responses_store_max_age
        )
        self.running: dict[str, tuple[RequestStream, ResponseObject]] = {}

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        self.state.check_model(req.model, required=True)
        check_request(req)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise bad_request(
                    f"previous_response_id {req.previous_response_id!r} is not "
                    "a stored response of this server",
                    "previous_response_id",
                )
            history = prev.messages
        items = input_items(req)
        chat_req = to_chat_request(req, history, items)
        prep = await off_loop(self.state, self.chat.prepare, chat_req, "resp")
        stream, first = await self.chat.start(prep, chat_req, raw)
        resp = ResponseObject.start(item_id("resp"), self.state.model_name, req)
        summary = wants_summary(req)
        if req.stream:
            run = _Run(self, resp, prep, stream, chat_req.messages, items, summary)
            return StreamingResponse(run.events(first), media_type="text/event-stream")
        comp = first.outputs[0]
        parts = prep.parser.parse(comp.text, final=True)
        if parts.reasoning:
            resp.output.append(reasoning_item(parts.reasoning, summary))
        if parts.content or not parts.calls:
            logprobs = _text_logprobs(comp, prep.top_n, parts.content)
            resp.output.append(message_item(parts.content, logprobs=logprobs))
        for call in parts.calls:
            resp.output.append(call_item(call, _call_id(prep)))
        self._complete(resp, first, parts.reasoning or "", chat_req.messages, items)
        return JSONResponse(resp.model_dump())

    def _complete(
        self,
        resp: ResponseObject,
        out: RequestOutput,
        reasoning: str,
        messages: list[dict[str, Any]],
        items: list[dict[str, Any]],
    ) -> None:
        comp = out.outputs[0]
        finish(resp, comp.finish_reason)
        n_reasoning = (
            len(self.state.tokenizer.encode(reasoning, add_special_tokens=False))
            if reasoning
            else 0
        )
        resp.usage = usage(
            len(out.prompt_token_ids), len(comp.token_ids), out.num_cached_tokens, n_reasoning
        )
        if resp.store:
            body = resp.model_dump()
            self.store.put(
                resp.id, Stored(body, items, messages + to_messages(resp.output), time.monotonic())
            )

    # -- GET / DELETE / cancel / input_items ------------------------------------------------
    def get(self, rid: str) -> dict[str, Any]:
        if rid in self.running:
            return self.running[rid][1].model_dump()
        stored = self.store.get(rid)
        if stored is None:
            raise _not_found(rid)
        return stored.response

    def delete(self, rid: str) -> dict[str, Any]:
        if not self.store.delete(rid):
            raise _not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    def cancel(self, rid: str) -> dict[str, Any]:
        if rid in self.running:
            stream, resp = self.running.pop(rid)
            stream.close()  # aborts: the KV blocks are free within a step
            resp.status = "cancelled"
            return resp.model_dump()
        stored = self.store.get(rid)
        if stored is None:
            raise _not_found(rid)
        raise bad_request(
            f"response {rid!r} is {stored.response['status']}: only a response "
            "that is still being generated can be cancelled",
            "response_id",
        )

    def input_items(
        self, rid: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        stored = self.store.get(rid)
        if stored is None:
            raise _not_found(rid)
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise bad_request("order must be asc or desc and limit in [1, 100]", "order")
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
        }


def _logprobs(comp: CompletionOutput, top_n: int | None) -> list[dict[str, Any]] | None:
    """The Responses API's logprobs of the output's tokens (None: not asked for)."""
    if top_n is None or not comp.logprobs:
        return None
    got = chat_logprobs(comp.token_ids, comp.logprobs, top_n).content or []
    return [lp.model_dump() for lp in got]


def _text_logprobs(
    comp: CompletionOutput, top_n: int | None, content: str
) -> list[dict[str, Any]] | None:
    """Logprobs of the tokens that wrote ``content``: the output's tokens whose text overlaps
    where ``content`` lies in it (reasoning and tool-call tokens are left out)."""
    every = _logprobs(comp, top_n)
    if every is None:
        return None
    full = "".join(lp["token"] for lp in every)
    start = full.find(content) if content else -1
    if start < 0:
        return every if full == content else []
    end, offset, picked = start + len(content), 0, []
    for lp in every:
        if offset < end and offset + len(lp["token"]) > start:
            picked.append(lp)
        offset += len(lp["token"])
    return picked


def _call_id(prep: PreparedChat) -> str:
    tools = prep.parser.tools
    return tools.new_call_id() if tools is not None else item_id("call")


class _Run:
    """One streamed response: engine deltas -> the Responses API's event sequence."""

    def __init__(
        self,
        handler: ResponsesHandler,
        resp: ResponseObject,
        prep: PreparedChat,
        stream: RequestStream,
        messages: list[dict[str, Any]],
        items: list[dict[str, Any]],
        summary: bool,
    ) -> None:
        self.handler, self.resp, self.prep, self.stream = handler, resp, prep, stream
        self.messages, self.items = messages, items
        self.summary = summary
        # reasoning streams as a summary (asked for) or as reasoning_text content:
        # (part events, text events, index key, part type)
        self.reasoning_events = (
            ("response.reasoning_summary_part", "response.reasoning_summary_text",
             "summary_index", "summary_text")
            if summary
            else ("response.content_part", "response.reasoning_text", "content_index",
                  "reasoning_text")
        )  # fmt: skip
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.reasoning = ""

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def events(self, first: RequestOutput) -> AsyncIterator[str]:
        self.handler.running[self.resp.id] = (self.stream, self.resp)
        streamer = ChatStreamer(self.prep.parser)
        out: RequestOutput | None = first
        last = first
        try:
            yield self._event("response.created", response=self.resp.model_dump())
            yield self._event("response.in_progress", response=self.resp.model_dump())
            while out is not None:
                raise_if_failed(out)
                last = out
                comp = out.outputs[0]
                delta = streamer.feed(comp.text, final=comp.finish_reason is not None)
                for event in self._feed(delta, _logprobs(comp, self.prep.top_n) or []):
                    yield event
                out = None if out.finished else await anext(self.stream, None)
            if self.open is None and not self.resp.output:
                for event in self._open("message"):
                    yield event
            for event in self._close():
                yield event
            self.handler._complete(self.resp, last, self.reasoning, self.messages, self.items)
            done = (
                "response.incomplete"
                if self.resp.status == "incomplete"
                else ("response.completed")
            )
            yield self._event(done, response=self.resp.model_dump())
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-stream
            error = from_exception(exc)
            self.resp.status = "failed"
            self.resp.error = {"code": error.code or "server_error", "message": error.message}
            yield self._event("response.failed", response=self.resp.model_dump())
        finally:
            self.handler.running.pop(self.resp.id, None)
            self.stream.close()

    # -- items ------------------------------------------------------------------------------
    def _feed(self, delta: DeltaParts, logprobs: list[dict[str, Any]]) -> list[str]:
        """Events of one engine delta; its tokens' ``logprobs`` go with its text, if it has
        some (a step that writes reasoning or a call and text gives them to the text)."""
        events: list[str] = []
        if delta.reasoning:
            self.reasoning += delta.reasoning
            events += self._open("reasoning")
            _, text_events, index_key, _ = self.reasoning_events
            events.append(
                self._text_delta(text_events + ".delta", delta.reasoning, **{index_key: 0})
            )
        if delta.content:
            events += self._open("message")
            self.open["logprobs"] += logprobs  # type: ignore[index]
            events.append(
                self._text_delta(
                    "response.output_text.delta", delta.content, content_index=0, logprobs=logprobs
                )
            )
        for call in delta.calls:
            fn = call["function"]
            if "id" in call:
                events += self._close()
                item = call_item(ToolCall(fn["name"], ""), call["id"], status="in_progress")
                events += self._added(item, "function_call")
            if fn.get("arguments"):
                self.open["text"] += fn["arguments"]  # type: ignore[index]
                events.append(
                    self._text_delta("response.function_call_arguments.delta", fn["arguments"])
                )
        return events

    def _text_delta(self, kind: str, text: str, **fields: Any) -> str:
        item = self.open
        assert item is not None, "a delta goes to the open item"
        if item["kind"] != "function_call":
            item["text"] += text
        return self._event(
            kind, item_id=item["item"]["id"], output_index=item["index"], delta=text, **fields
        )

    def _open(self, kind: str) -> list[str]:
        if self.open is not None and self.open["kind"] == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            item = {**reasoning_item("", False), "content": [], "status": "in_progress"}
            events += self._added(item, kind)
            part_events, _, index_key, part_type = self.reasoning_events
            events.append(
                self._event(
                    part_events + ".added",
                    **self._where(),
                    **{index_key: 0},
                    part={"type": part_type, "text": ""},
                )
            )
        else:
            item = {**message_item(""), "content": [], "status": "in_progress"}
            events += self._added(item, kind)
            events.append(
                self._event(
                    "response.content_part.added",
                    **self._where(),
                    content_index=0,
                    part=output_text(""),
                )
            )
        return events

    def _added(self, item: dict[str, Any], kind: str) -> list[str]:
        self.open = {
            "kind": kind,
            "item": item,
            "index": len(self.resp.output),
            "text": "",
            "logprobs": [],
        }
        return [
            self._event("response.output_item.added", output_index=self.open["index"], item=item)
        ]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["item"]["id"], "output_index": self.open["index"]}  # type: ignore[index]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        kind, item, text = self.open["kind"], self.open["item"], self.open["text"]
        where = self._where()
        if kind == "reasoning":
            part_events, text_events, index_key, part_type = self.reasoning_events
            at = {**where, index_key: 0}
            events = [
                self._event(text_events + ".done", **at, text=text),
                self._event(part_events + ".done", **at, part={"type": part_type, "text": text}),
            ]
            item = reasoning_item(text, self.summary, item["id"])
        elif kind == "message":
            logprobs = self.open["logprobs"]
            events = [
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=text,
                    logprobs=logprobs,
                ),
                self._event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=output_text(text, logprobs),
                ),
            ]
            item = message_item(text, item["id"], logprobs=logprobs)
        else:
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    arguments=text,
                    name=item["name"],
                )
            ]
            item = {**item, "arguments": text, "status": "completed"}
        self.resp.output.append(item)
        self.open = None
        return events + [
            self._event("response.output_item.done", output_index=where["output_index"], item=item)
        ]
