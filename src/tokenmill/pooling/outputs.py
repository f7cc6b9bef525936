"""Results of pooling requests, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class PoolingOutput:
    data: torch.Tensor
    """What the task produced: [D] embedding, [C] probabilities, [L, H] token states."""


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class ClassificationOutput:
    probs: list[float]
    """Softmax probabilities (sigmoid for one label; raw logits with activation=False)."""

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True)
class ScoringOutput:
    score: float
    """Cosine similarity (embedding models) or the cross-encoder's sigmoid score."""


@dataclass(frozen=True)
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """``LLM.embed``'s result per prompt."""


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """``LLM.classify``'s result per prompt."""


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """``LLM.score``'s result per pair."""
