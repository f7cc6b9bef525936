"""The sampler: logits of one step -> next token ids (and logprobs) for every row.

Order of operations (vLLM v1's):

1. logprobs are taken from the **raw** logits (``log_softmax`` before any
   processing), so they describe the model's distribution, not the filtered one;
2. row processors, in order: logit_bias, min_tokens suppression of EOS and
   stop_token_ids, repetition penalty, frequency/presence penalties;
3. greedy rows (temperature < 1e-5) take ``argmax`` (ties -> first index);
4. random rows: temperature, min-p, top-k, top-p, softmax, then the
   exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``, which samples exactly
   from ``probs``. A seeded row draws its ``q`` ([V]) from its own generator, seeded
   for the token's output position (``position_seed``), so its tokens depend neither
   on the rest of the batch nor on speculation.

The sampler never reads a device value back: the engine does that once per step
on ``SamplerOutput`` (the only device-to-host point of the sampling path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.sampling.argmax import argmax_rows
from tokenmill.sampling.batch import PlanCache, Processor, RandomRows
from tokenmill.sampling.logits_processors import (
    RowProcessor,
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    default_processors,
)
from tokenmill.sampling.penalty_history import PenaltyHistories
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.structured_output.state import StructuredRequest


class SamplingRow(Protocol):
    """What the sampler reads of one row: ``RowState``'s fields. The engine's ``Request``
    has them under the same names and is passed as is (no per-row object per step)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def generator(self) -> torch.Generator | None: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def structured(self) -> StructuredRequest | None: ...
    @property
    def num_placeholders(self) -> int:
        """Tokens in flight, the one this row samples included: the row's outputs so far
        number ``len(output_token_ids) + num_placeholders - 1``."""
        ...


@dataclass
class RowState:
    """One row of the logits batch: what one request needs to pick its next token."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Tokens generated so far (before this step)."""
    generator: torch.Generator | None = None
    """The request's own generator (on the logits' device) when ``params.seed`` is set.

    Owned by the request and re-seeded before each of its draws for the token's
    position (``position_seed``). Create it with ``make_generator``.
    """
    eos_token_ids: frozenset[int] = frozenset()
    """Suppressed, with ``params.stop_token_ids``, while len(output) < min_tokens."""
    structured: StructuredRequest | None = None
    """The request's grammar state (read by the structured-output mask processor)."""
    num_placeholders: int = 1
    """Tokens in flight, this row's included (``SamplingRow.num_placeholders``)."""


@dataclass(frozen=True)
class LogprobsTensors:
    """Log-probabilities of a batch of rows (log_softmax of the raw logits)."""

    sampled_logprob: torch.Tensor
    """[N] float32: logprob of the chosen token."""
    sampled_rank: torch.Tensor
    """[N] int64: rank of the chosen token, 1 = most likely (ties share the worst rank)."""
    top_ids: torch.Tensor
    """[N, K] int64: the K most likely tokens, most likely first."""
    top_logprobs: torch.Tensor
    """[N, K] float32: their logprobs."""


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor
    """[N] int64 sampled ids."""
    logprobs: LogprobsTensors | None
    """None when no row asked for logprobs. Otherwise computed for every row with
    K = the largest ``params.logprobs`` in the batch (at most V): a row that asked for k < K
    takes ``top_ids[i, :k]``; rows that did not ask ignore theirs."""


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for ``SamplingParams.seed``."""
    return torch.Generator(device=device).manual_seed(seed)


def compute_logprobs(logits: torch.Tensor, k: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """logits [N, V] (raw), k >= 0, token_ids [N] -> logprobs of token_ids and the top k.

    Also used for prompt logprobs: logits of positions 0..T-2, token_ids = prompt[1:].
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, V]
    return _gather_logprobs(logprobs, k, token_ids)


def _gather_logprobs(logprobs: torch.Tensor, k: int, token_ids: torch.Tensor) -> LogprobsTensors:
    k = min(k, logprobs.shape[1])
    sampled = logprobs.gather(1, token_ids[:, None].to(torch.int64))  # [N, 1]
    rank = (logprobs >= sampled).sum(dim=-1)  # [N]
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [N, k]
    return LogprobsTensors(
        sampled_logprob=sampled.squeeze(1),
        sampled_rank=rank.to(torch.int64),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )


class Sampler:
    """Picks the next token of every row; see the module docstring for the order.

    ``default_generator`` serves the unseeded random rows (None = torch's default
    generator of the logits' device). ``processors`` replaces the built-in row
    processors; ``extra_processors`` run after them (e.g. grammar masks). What each row
    needs is planned once per batch composition (``batch.py``), and penalised requests'
    token counts live on the device across steps (``penalty_history.py``).
    """

    def __init__(
        self,
        default_generator: torch.Generator | None = None,
        processors: Sequence[Processor] | None = None,
        extra_processors: Sequence[Processor] = (),
    ) -> None:
        self.default_generator = default_generator
        self.histories = PenaltyHistories()
        if processors is None:
            processors = default_processors(self.histories)
        self.processors = tuple(processors) + tuple(extra_processors)
        self.plans = PlanCache()

    def argmax_only(self, rows: Sequence[SamplingRow], device: torch.device) -> bool:
        """Whether this sampler would take every row's argmax of the raw logits: all
        greedy, no logprobs, no processor touching any row (``greedy_head.py`` then
        computes the tokens without the logits)."""
        plan = self.plans.get(rows, self.processors, device)
        return (
            plan.random is None
            and plan.max_logprobs is None
            and not any(only is None or only for only in plan.only)
        )

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], in_place: bool = False
    ) -> SamplerOutput:
        """logits [N, V] float32, rows: N row states -> SamplerOutput.

        ``logits`` is left untouched unless ``in_place``: then the processors edit it
        instead of a copy (the runner's fresh logits, which nothing reads afterwards: one
        [N, V] float32 copy less per step, 131 MB at 256 rows of a 128k vocabulary)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one row state per logits row"
        plan = self.plans.get(rows, self.processors, logits.device)
        k = plan.max_logprobs
        raw_logprobs = None if k is None else torch.log_softmax(logits.float(), dim=-1)
        if not (in_place and logits.dtype == torch.float32):
            logits = logits.to(torch.float32, copy=True)  # [N, V] working copy
        for process, only in zip(self.processors, plan.only):
            if only is None:
                process(logits, rows)
            elif only:
                assert isinstance(process, RowProcessor)
                process.apply(logits, rows, only)
        token_ids = self._pick(logits, rows, plan.random)  # [N]
        logprobs = None
        if raw_logprobs is not None and k is not None:
            logprobs = _gather_logprobs(raw_logprobs, k, token_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _pick(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], random: RandomRows | None
    ) -> torch.Tensor:
        if random is None:
            return argmax_rows(logits)
        if random.index_tensor is None:  # every row samples
            return self._sample(logits, [rows[i] for i in random.index], random)
        token_ids = argmax_rows(logits)  # [N]; random rows overwritten below
        index = random.index_tensor
        token_ids[index] = self._sample(logits[index], [rows[i] for i in random.index], random)
        return token_ids

    def _sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], random: RandomRows
    ) -> torch.Tensor:
        """logits [S, V] of random rows (modified in place) -> [S] int64 sampled ids."""
        if random.temperature is not None:
            apply_temperature(logits, random.temperature)
        if random.min_p is not None:
            apply_min_p(logits, random.min_p)
        top_k = random.top_k
        if top_k is not None:  # 0 (off) or beyond the vocabulary: V, which keeps every token
            vocab = logits.shape[1]
            top_k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        if top_k is not None or random.top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, random.top_p)
        probs = logits.softmax(dim=-1)  # [S, V]
        return argmax_rows(probs.div_(self._exponential(probs, rows, random)))

    def _exponential(
        self, probs: torch.Tensor, rows: Sequence[SamplingRow], random: RandomRows
    ) -> torch.Tensor:
        """q [S, V] ~ Exp(1): seeded rows from their own generator, others from the default."""
        seeded, unseeded = random.seeded, random.unseeded
        q = torch.empty_like(probs)
        if not seeded:
            q.exponential_(generator=self.default_generator)
        elif unseeded is not None:
            draw = probs.new_empty(unseeded.shape[0], probs.shape[1])
            q[unseeded] = draw.exponential_(generator=self.default_generator)
        for i in seeded:
            row = rows[i]
            assert row.generator is not None
            position = len(row.output_token_ids) + row.num_placeholders - 1
            row.generator.manual_seed(position_seed(row.params.seed or 0, position))
            q[i].exponential_(generator=row.generator)
        # q == 0 would turn a masked token (prob 0) into 0/0 = nan, which argmax picks.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for its output token ``position`` (splitmix64
    of both): a token's noise depends only on the request's seed and where the token is,
    not on how many draws came before, so the output is the same whether the step
    verified drafts (one draw per row, some rows rejected) or decoded one token."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: manual_seed takes a signed 64-bit value


_MASK64 = (1 << 64) - 1
