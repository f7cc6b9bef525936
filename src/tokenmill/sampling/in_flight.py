"""A sampling row whose latest output token is still on the device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.sampling.sampler import SamplingRow
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.structured_output.state import StructuredRequest


class InFlightRow:
    """A row whose latest output token is still on the device (asynchronous scheduling):
    ``request``'s sampling state, and that token at ``source[index]``. Penalties count it
    on the device (``logits_processors.apply_penalties``), so they need no host sync."""

    __slots__ = ("request", "source", "index")

    def __eq__(self, other: object) -> bool:
        """The same row as its request for the sampler's plan (``batch.PlanCache``): the
        plan reads only a row's fixed state; the token in flight is read per step."""
        return self.request is getattr(other, "request", other)

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, request: SamplingRow, source: torch.Tensor, index: int) -> None:
        self.request = request
        self.source = source
        """[S] int64 (device): the previous step's sampled ids."""
        self.index = index

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The outputs on the host: all but the one in flight."""
        return self.request.output_token_ids

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.request.eos_token_ids

    @property
    def structured(self) -> StructuredRequest | None:
        return self.request.structured

    @property
    def num_placeholders(self) -> int:
        return self.request.num_placeholders
