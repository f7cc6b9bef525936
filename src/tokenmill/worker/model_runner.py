"""One step on one device: inputs -> model -> logits (only where needed) -> tokens.

The only device-to-host copy of a step is in ``_to_host``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention import AttentionMetadata, ForwardContext
from tokenmill.models.base import CausalLM
from tokenmill.sampling import LogprobsTensors, RowState, Sampler, compute_logprobs
from tokenmill.scheduler import ScheduledSeq, SchedulerOutput


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of one chosen token plus the top-k alternatives at its position."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    """For requests that asked for logprobs: the sampled token's."""
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]]
    """request id -> (prompt position of the first entry, entries). Entry j scores
    prompt token start + j + 1 given everything before it."""


def allocate_kv_caches(
    model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer.

    Zeroed, not empty: padded positions are masked but still multiplied by 0.
    """
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        seqs = sched.seqs
        input_ids, positions, meta = self._prepare_inputs(seqs)
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.kv_caches))
        sample_seqs = [s for s in seqs if s.samples]
        sampled_rows = [meta.query_start_loc[i + 1] - 1 for i, s in enumerate(seqs) if s.samples]
        sampled = lp = None
        if sample_seqs:
            logits = self.model.compute_logits(hidden[sampled_rows])
            out = self.sampler(logits, [_row_state(s) for s in sample_seqs])
            sampled, lp = out.token_ids, out.logprobs
        prompt_lp = self._prompt_logprobs(seqs, meta, hidden)
        return _to_host(sample_seqs, sampled, lp, prompt_lp)

    def _prepare_inputs(
        self, seqs: tuple[ScheduledSeq, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        pos: list[int] = []
        for s in seqs:
            ids.extend(s.request.all_token_ids[s.start : s.end])
            pos.extend(range(s.start, s.end))
        meta = AttentionMetadata.build(
            query_lens=[s.num_new_tokens for s in seqs],
            seq_lens=[s.end for s in seqs],
            block_tables=[list(s.block_table) for s in seqs],
            block_size=self.block_size,
            device=self.device,
        )
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(pos), meta

    def _prompt_logprobs(
        self, seqs: tuple[ScheduledSeq, ...], meta: AttentionMetadata, hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[int], LogprobsTensors]]:
        """Score the prompt tokens this chunk predicts, for requests that asked."""
        result: dict[str, tuple[int, list[int], LogprobsTensors]] = {}
        for i, s in enumerate(seqs):
            req = s.request
            k = req.params.prompt_logprobs
            last = min(s.end, req.num_prompt_tokens - 1)  # positions predicting a prompt token
            if k is None or s.start >= last:
                continue
            row0 = meta.query_start_loc[i]
            logits = self.model.compute_logits(hidden[row0 : row0 + last - s.start])
            targets = torch.tensor(
                req.prompt_token_ids[s.start + 1 : last + 1], dtype=torch.int64, device=self.device
            )
            lp = compute_logprobs(logits, k, targets)
            result[req.request_id] = (s.start, req.prompt_token_ids[s.start + 1 : last + 1], lp)
        return result


def _row_state(s: ScheduledSeq) -> RowState:
    req = s.request
    return RowState(
        params=req.params,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids,
        generator=req.generator,
        eos_token_ids=req.eos_token_ids,
        structured=req.structured,
    )


def _entries(lp, token_ids: list[int]) -> list[TokenLogprobs]:
    """Host-side rows of a LogprobsTensors, for the given chosen tokens."""
    return [
        TokenLogprobs(t, v, r, tuple(zip(i, x)))
        for t, v, r, i, x in zip(
            token_ids,
            lp.sampled_logprob.tolist(),
            lp.sampled_rank.tolist(),
            lp.top_ids.tolist(),
            lp.top_logprobs.tolist(),
        )
    ]


def _to_host(sample_seqs, sampled, lp, prompt_lp) -> ModelRunnerOutput:
    """The single device-to-host synchronisation point of a step."""
    token_list = sampled.tolist() if sampled is not None else []
    ids = [s.request.request_id for s in sample_seqs]
    logprobs: dict[str, TokenLogprobs] = {}
    if lp is not None:
        for s, entry in zip(sample_seqs, _entries(lp, token_list)):
            k = s.request.params.logprobs
            if k is not None:
                logprobs[s.request.request_id] = TokenLogprobs(
                    entry.token_id, entry.logprob, entry.rank, entry.top[:k]
                )
    prompt = {
        rid: (start, _entries(plp, targets)) for rid, (start, targets, plp) in prompt_lp.items()
    }
    return ModelRunnerOutput(dict(zip(ids, token_list)), logprobs, prompt)
