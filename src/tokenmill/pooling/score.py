"""Pairs to score: vLLM's 1 -> 1, 1 -> N and N -> N rules, and how each model scores them.

An embedding model scores a pair by the cosine of the two embeddings; a one-label
classifier (cross-encoder) reads the pair as one sequence and gives sigmoid(logit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tokenmill.errors import InvalidRequestError
from tokenmill.pooling.params import PoolingParams
from tokenmill.pooling.tokenize import Encoded


def pair_up(
    data_1: str | Sequence[str], data_2: str | Sequence[str]
) -> tuple[list[str], list[str]]:
    """Both sides as equal-length lists: one text against N is repeated N times."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if not firsts or not seconds:
        raise InvalidRequestError("score needs at least one text on each side; a side is empty")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidRequestError(
            f"score pairs 1 -> 1, 1 -> N or N -> N texts; got {len(firsts)} -> {len(seconds)}: "
            "send one first text, or as many first texts as second texts"
        )
    for text in (*firsts, *seconds):
        if not isinstance(text, str):
            raise InvalidRequestError(f"texts to score must be strings, got {type(text).__name__}")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    return firsts, seconds


def score_plan(engine, firsts: list[str], seconds: list[str], truncate: int | None):
    """-> (encoded inputs, the task to run them with, a function from raw outputs to
    one score per pair). Validation and tokenization only: any thread."""
    engine.check_task("score")
    params = PoolingParams(truncate_prompt_tokens=truncate)
    if engine.plan.convert == "classify":
        encoded = engine.prepare_pairs(firsts, seconds, truncate)

        def from_logits(raw: list[torch.Tensor]) -> list[float]:
            return [float(engine.finish(r, params, "score")[0]) for r in raw]

        return encoded, "score", from_logits
    texts = list(dict.fromkeys([*firsts, *seconds]))  # each distinct text embedded once
    where = {t: i for i, t in enumerate(texts)}
    embed_inputs: list[Encoded] = engine.prepare(texts, params, "embed")

    def cosine(raw: list[torch.Tensor]) -> list[float]:
        vecs = torch.stack(raw)
        a = vecs[[where[t] for t in firsts]]
        b = vecs[[where[t] for t in seconds]]
        return F.cosine_similarity(a, b, dim=-1).tolist()

    return embed_inputs, "embed", cosine
