"""Sampling: per-request logits processing and next-token selection."""

from tokenmill.sampling.logits_processors import DEFAULT_PROCESSORS, LogitsProcessor
from tokenmill.sampling.sampler import (
    LogprobsTensors,
    RowState,
    Sampler,
    SamplerOutput,
    compute_logprobs,
    make_generator,
)

__all__ = [
    "DEFAULT_PROCESSORS",
    "LogitsProcessor",
    "LogprobsTensors",
    "RowState",
    "Sampler",
    "SamplerOutput",
    "compute_logprobs",
    "make_generator",
]
