"""Pooling models: embed, score, rerank and classify (no KV cache, no sampler)."""

from tokenmill.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.pooling.params import PoolingParams

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
