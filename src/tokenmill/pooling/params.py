"""``PoolingParams``: what one pooling request asks for (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.errors import InvalidRequestError

POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
"""What ``LLM.encode(..., pooling_task=...)`` may ask: a sequence embedding, class
probabilities, a cross-encoder score (one label, sigmoid), per-token hidden states, or
per-token class probabilities (a token classifier; ``LLM.reward``)."""


@dataclass
class PoolingParams:
    """Options of one pooling request; None means "the model's default"."""

    truncate_prompt_tokens: int | None = None
    """Keep this many prompt tokens (-1: as many as the model takes); for text the
    tokenizer cuts the content and keeps the special tokens, for token ids the last ones
    are kept. None: a prompt over the model's limit is an error."""
    normalize: bool | None = None
    """L2-normalize embeddings (default: what the checkpoint says, e.g. a Normalize module)."""
    dimensions: int | None = None
    """Keep the first n embedding dimensions (Matryoshka models only), then normalize."""
    activation: bool | None = None
    """Apply the classifier's activation (softmax, or sigmoid for one label); default True."""
    use_activation: bool | None = None
    """vLLM's newer name of ``activation``."""

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < -1 or t == 0):
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be a positive integer or -1, got {t!r}"
            )
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {d!r}")
        if self.use_activation is not None and self.activation is None:
            self.activation = self.use_activation

    def clone(self) -> PoolingParams:
        return PoolingParams(**self.__dict__)
