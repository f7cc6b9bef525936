"""The pooling routes: /v1/embeddings, /score, /rerank, /classify, /pooling.

``add_pooling_routes(app, state)`` registers them and a guard that answers a text
generation route with a 400 while a pooling model is served. Each handler validates,
tokenizes on the preprocessing pool (``off_loop``), awaits the engine thread
(``AsyncPoolingLLM.run``, batched with other requests) and finishes per request.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import torch
from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.preprocess import check_unicode, off_loop
from tokenmill.entrypoints.openai.protocol_pooling import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    EmbeddingData,
    EmbeddingInput,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from tokenmill.entrypoints.openai.serving_common import unless_disconnected
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.errors import InvalidRequestError
from tokenmill.pooling.engine import Prompt
from tokenmill.pooling.frontend import AsyncPoolingLLM
from tokenmill.pooling.params import POOLING_TASKS, PoolingParams
from tokenmill.pooling.score import pair_up, score_plan
from tokenmill.pooling.tokenize import Encoded

GENERATION_PREFIXES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
"""Routes that generate text: a pooling model answers them with a 400."""


def model_task(state: ServerState) -> str | None:
    """What ``/v1/models`` reports: embed, score, classify, or generate."""
    llm = state.llm
    if llm is None:
        return None
    return llm.engine.task if isinstance(llm, AsyncPoolingLLM) else "generate"


class GenerationGuard:
    """Plain ASGI: a generation route on a pooling model is a 400 naming the routes to use."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        llm = self.state.llm
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if isinstance(llm, AsyncPoolingLLM) and path.startswith(GENERATION_PREFIXES):
            error = APIError(
                400,
                f"{path} generates text, but this server runs a pooling model (task "
                f"{llm.engine.task!r}): use /v1/embeddings, /score, /rerank, /classify or "
                "/pooling, or serve a generative model",
                code="model_does_not_support_route",
            )
            if path.startswith("/v1/messages"):
                from tokenmill.entrypoints.openai.protocol_messages import anthropic_error

                return await anthropic_error(error)(scope, receive, send)
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class PoolingHandler:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def llm(self, route: str, model: str | None) -> AsyncPoolingLLM:
        self.state.check_model(model)
        llm = self.state.require_llm()
        if not isinstance(llm, AsyncPoolingLLM):
            raise APIError(
                400,
                f"{route} needs a pooling model (embedding, cross-encoder or classifier), but "
                "this server runs a generative model; serve such a checkpoint (or pass "
                "--runner pooling)",
                code="model_does_not_support_route",
            )
        return llm

    def prompts(self, value: EmbeddingInput, where: str = "input") -> list[Prompt]:
        if isinstance(value, str):
            items: list[Any] = [value]
        elif value and all(isinstance(t, int) for t in value):
            items = [value]  # one prompt as token ids
        else:
            items = list(value)
        if not items:
            raise bad_request(f"'{where}' is an empty list; send at least one input", where)
        limit = self.state.config.limits.max_prompts_per_request
        if len(items) > limit:
            raise bad_request(f"'{where}' has {len(items)} items, over the limit of {limit}", where)
        check_unicode(items, where)
        return items

    async def pool(
        self,
        llm: AsyncPoolingLLM,
        prompts: Sequence[Prompt],
        params: PoolingParams,
        task: str,
        http: Request,
    ) -> tuple[list[torch.Tensor], list[Encoded]]:
        """Tokenize off the loop, run on the engine thread, finish: (tensors, inputs). A
        client that disconnects first has its job dropped (``unless_disconnected``)."""
        encoded = await off_loop(self.state, llm.engine.prepare, prompts, params, task)
        raw = await unless_disconnected(http, llm.run(encoded, task))
        return [llm.engine.finish(r, params, task) for r in raw], encoded

    # -- routes -----------------------------------------------------------------------------
    async def embeddings(self, req: EmbeddingRequest, http: Request) -> EmbeddingResponse:
        llm = self.llm("/v1/embeddings", req.model)
        params = _params(
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            dimensions=req.dimensions,
            normalize=req.normalize,
        )
        vecs, encoded = await self.pool(llm, self.prompts(req.input), params, "embed", http)
        data = [
            EmbeddingData(index=i, embedding=_encode_vector(v, req.encoding_format))
            for i, v in enumerate(vecs)
        ]
        return EmbeddingResponse(model=self.state.model_name, data=data, usage=_usage(encoded))

    async def score(self, req: ScoreRequest, http: Request) -> ScoreResponse:
        first = req.text_1 if req.text_1 is not None else req.queries
        second = req.text_2 if req.text_2 is not None else req.documents
        if first is None or second is None:
            raise bad_request("send 'text_1' and 'text_2' (or 'queries' and 'documents')")
        scores, tokens = await self.scores(
            "/score", req.model, first, second, req.truncate_prompt_tokens, http
        )
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(
            model=self.state.model_name,
            data=data,
            usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def rerank(self, req: RerankRequest, http: Request) -> RerankResponse:
        if req.top_n is not None and req.top_n < 0:
            raise bad_request(f"top_n must be >= 0, got {req.top_n}", "top_n")
        scores, tokens = await self.scores(
            "/rerank", req.model, req.query, req.documents, req.truncate_prompt_tokens, http
        )
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=req.documents[i]) if req.return_documents else None,
            )
            for i in order
        ]
        return RerankResponse(
            model=self.state.model_name, usage=RerankUsage(total_tokens=tokens), results=results
        )

    async def scores(
        self,
        route: str,
        model: str | None,
        first: str | list[str],
        second: str | list[str],
        truncate: int | None,
        http: Request,
    ) -> tuple[list[float], int]:
        llm = self.llm(route, model)
        check_unicode([first, second], "documents")
        firsts, seconds = _or_400(pair_up, first, second)
        limit = self.state.config.limits.max_prompts_per_request
        if len(seconds) > limit:
            raise bad_request(f"{len(seconds)} pairs to score, over the limit of {limit}")
        encoded, task, combine = await off_loop(
            self.state, score_plan, llm.engine, firsts, seconds, truncate
        )
        scores = combine(await unless_disconnected(http, llm.run(encoded, task)))
        return scores, sum(len(e.token_ids) for e in encoded)

    async def classify(self, req: ClassifyRequest, http: Request) -> ClassifyResponse:
        llm = self.llm("/classify", req.model)
        params = _params(
            truncate_prompt_tokens=req.truncate_prompt_tokens, activation=req.activation
        )
        probs, encoded = await self.pool(llm, self.prompts(req.input), params, "classify", http)
        labels = llm.engine.plan.checkpoint.hf_config.get("id2label") or {}
        data = []
        for i, p in enumerate(probs):
            best = int(p.argmax())
            label = labels.get(best, labels.get(str(best)))
            data.append(ClassifyData(index=i, label=label, probs=p.tolist(), num_classes=len(p)))
        return ClassifyResponse(model=self.state.model_name, data=data, usage=_usage(encoded))

    async def pooling(self, req: PoolingRequest, http: Request) -> PoolingResponse:
        llm = self.llm("/pooling", req.model)
        task = req.task or llm.engine.task
        if task not in POOLING_TASKS:
            raise bad_request(
                f"task={task!r} is unknown; use one of {', '.join(POOLING_TASKS)}", "task"
            )
        params = _params(truncate_prompt_tokens=req.truncate_prompt_tokens, normalize=req.normalize)
        outs, encoded = await self.pool(llm, self.prompts(req.input), params, task, http)
        data = [
            PoolingData(
                index=i,
                data=_encode_vector(t.reshape(-1), "base64")
                if req.encoding_format == "base64"
                else t.tolist(),
            )
            for i, t in enumerate(outs)
        ]
        return PoolingResponse(model=self.state.model_name, data=data, usage=_usage(encoded))


def add_pooling_routes(app: FastAPI, state: ServerState) -> None:
    """Register the pooling routes and the generation-route guard on ``app``."""
    handler = PoolingHandler(state)
    app.add_middleware(GenerationGuard, state=state)
    app.post("/v1/embeddings")(handler.embeddings)
    for path in ("/score", "/v1/score"):
        app.post(path)(handler.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(handler.rerank)
    for path in ("/classify", "/v1/classify"):
        app.post(path)(handler.classify)
    app.post("/pooling")(handler.pooling)


def _params(**kwargs: Any) -> PoolingParams:
    try:
        return PoolingParams(**kwargs)
    except InvalidRequestError as e:
        raise bad_request(str(e)) from None


def _or_400(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except InvalidRequestError as e:
        raise bad_request(str(e)) from None


def _encode_vector(vec: torch.Tensor, fmt: str) -> list[float] | str:
    """float: a JSON list; base64: little-endian float32 bytes (OpenAI's format)."""
    if fmt == "base64":
        return base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def _usage(encoded: Sequence[Encoded]) -> PoolingUsage:
    tokens = sum(len(e.token_ids) for e in encoded)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
