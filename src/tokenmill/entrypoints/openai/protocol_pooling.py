"""Request and response bodies of the pooling routes: OpenAI's /v1/embeddings, vLLM's
/score, /rerank (Jina / Cohere shape), /classify and /pooling."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from tokenmill.entrypoints.openai.protocol import OpenAIModel

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PoolingUsage(OpenAIModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    """vLLM's extra: keep this many tokens (-1: the model's limit)."""
    normalize: bool | None = None
    """vLLM's extra: override the model's normalization."""


class EmbeddingData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreRequest(OpenAIModel):
    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    """vLLM's newer names of text_1 / text_2."""
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None


class ScoreData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    """Keep the best n results (None or 0: all)."""
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(OpenAIModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIModel):
    total_tokens: int = 0


class RerankResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassifyRequest(OpenAIModel):
    model: str | None = None
    input: EmbeddingInput
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None


class ClassifyData(OpenAIModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassifyResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassifyData]
    usage: PoolingUsage


class PoolingRequest(OpenAIModel):
    model: str | None = None
    input: EmbeddingInput
    task: str | None = None
    """embed, token_embed, classify, token_classify or score; default: the model's task."""
    encoding_format: Literal["float", "base64"] = "float"
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None


class PoolingData(OpenAIModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Any


class PoolingResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
