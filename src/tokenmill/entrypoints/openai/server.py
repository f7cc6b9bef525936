"""The FastAPI app: OpenAI routes, tokenizer routes, health, metrics, version.

``build_app(state)`` wires routes to the handlers in ``serving_*.py``; it reads
the engine from ``state`` on every request, so the app can start answering
(``/health`` = 503) while the model is still loading.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill import __version__
from tokenmill.distributed.router_metrics import RouterCollector
from tokenmill.entrypoints.openai.body_limit import BodyLimitMiddleware
from tokenmill.entrypoints.openai.errors import APIError, bad_request, install_handlers
from tokenmill.entrypoints.openai.preprocess import check_unicode, off_loop, render_chat
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenmill.entrypoints.openai.protocol_messages import anthropic_error
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest
from tokenmill.entrypoints.openai.serving_chat import ChatHandler
from tokenmill.entrypoints.openai.serving_common import ClientGone
from tokenmill.entrypoints.openai.serving_completion import CompletionHandler
from tokenmill.entrypoints.openai.serving_messages import MessagesHandler
from tokenmill.entrypoints.openai.serving_pooling import add_pooling_routes, model_task
from tokenmill.entrypoints.openai.serving_responses import ResponsesHandler
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.metrics.prometheus import make_registry
from tokenmill.metrics.startup import StartupCollector, engine_startup_phases
from tokenmill.multimodal.prometheus import MultiModalCollector, engine_multimodal_metrics

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
"""Routes that answer without the API key (load balancers probe them)."""


class APIKeyMiddleware:
    """Plain ASGI (streaming-safe): ``Authorization: Bearer <key>`` (or Anthropic's
    ``x-api-key: <key>``) on every other route."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")  # the scheme is case-insensitive (RFC 9110)
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            return await self.app(scope, receive, send)
        x_api_key = headers.get(b"x-api-key")
        if x_api_key is not None and hmac.compare_digest(x_api_key.strip(), self.expected):
            return await self.app(scope, receive, send)
        message = (
            "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            if not given and x_api_key is None
            else "invalid API key"
        )
        error = APIError(
            401,
            message,
            type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        if scope["path"].startswith("/v1/messages"):
            return await anthropic_error(error)(scope, receive, send)
        await error.response()(scope, receive, send)


def build_app(
    state: ServerState,
    on_startup: Callable[[], None] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The ASGI app over ``state``; ``on_startup``/``on_shutdown`` run in its lifespan."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            on_startup()
        yield
        if on_shutdown is not None:
            on_shutdown()

    docs = (
        {}
        if not state.config.disable_fastapi_docs
        else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    )
    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan, **docs)
    app.state.tokenmill = state
    install_handlers(app)
    add_pooling_routes(app, state)  # its guard is the innermost middleware

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left

    app.add_middleware(BodyLimitMiddleware, max_bytes=state.config.limits.max_request_body_bytes)
    if state.config.api_key:  # added last: checked first, before a body is read
        app.add_middleware(APIKeyMiddleware, api_key=state.config.api_key)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    chat = ChatHandler(state)
    completion = CompletionHandler(state)
    responses = ResponsesHandler(state, chat)
    messages = MessagesHandler(state, chat)
    registry = make_registry(
        lambda: state.llm.stats if state.llm is not None else None,
        lambda: state.llm.engine.kv.usage if state.llm is not None else 0.0,
        state.model_name,
        lambda: state.llm.engine.prefix_cache_metrics() if state.llm is not None else {},
    )
    registry.register(RouterCollector(lambda: state.llm, state.model_name))  # replicas
    registry.register(StartupCollector(lambda: engine_startup_phases(state.llm), state.model_name))
    registry.register(MultiModalCollector(  # tokenmill:mm_* (none for a text-only model)
        lambda: engine_multimodal_metrics(getattr(state.llm, "engine", None)), state.model_name
    ))  # fmt: skip

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completion.create(body, raw)

    @app.post("/v1/messages")
    async def create_message(raw: Request) -> Response:
        """Anthropic's Messages API (errors in Anthropic's format)."""
        return await messages.create(raw)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw: Request) -> Response:
        return await messages.count_tokens(raw)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await responses.create(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return responses.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        return responses.input_items(response_id, limit, order, after)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        max_len = state.llm.engine.max_model_len if state.llm is not None else None
        card = ModelCard(
            id=state.model_name,
            created=state.created,
            max_model_len=max_len,
            task=model_task(state),
        )
        return ModelList(data=[card])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        tok = state.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' (text) or 'messages' (a chat)")
        if body.messages is not None:
            ids = await off_loop(
                state,
                render_chat,
                state,
                tok,
                body.messages,
                request_template=body.chat_template,
                server_template=state.template_override,
                prompt_logprobs=None,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=body.tools,
                **(body.chat_template_kwargs or {}),
            )
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            check_unicode(body.prompt, "prompt")
            ids = await off_loop(state, tok.encode, body.prompt or "", add_special_tokens=special)
        strs = tok.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        tok = state.tokenizer
        bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise bad_request(
                f"token ids must be in [0, {tok.vocab_size}); got {bad[:5]}", "tokens"
            )
        return DetokenizeResponse(prompt=tok.decode(body.tokens, skip_special_tokens=False))

    @app.get("/health")
    async def health() -> Response:
        if state.ready:  # data-parallel replicas: "degraded" while one is down
            replicas = getattr(state.llm, "health", None)
            return JSONResponse(replicas() if replicas is not None else {"status": "ok"})
        if state.draining or (state.llm is not None and not state.llm.is_accepting):
            status, code = "the server is shutting down", "draining"
        elif state.llm is None:
            status, code = "the model is loading", "loading"
        else:
            status, code = "the engine stopped", "engine_dead"
        return APIError(503, status, type="service_unavailable_error", code=code).response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        """Admin: forget every cached KV block (API-key protected like /v1)."""
        if state.llm is None:
            raise APIError(
                503, "the model is loading", type="service_unavailable_error", code="loading"
            )
        return {"reset_blocks": await state.llm.reset_prefix_cache()}

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__}
