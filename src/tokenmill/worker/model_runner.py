"""One step on one device: inputs -> model -> logits (only where needed) -> tokens.

Every integer input of a step goes to the device in one copy (``inputs.py``); the one
device-to-host wait is for the sampled ids. ``launch`` queues a step, ``collect`` waits
for it: with asynchronous scheduling the engine launches the next step in between, its
input tokens then taken on the device from this step's sampled ids (``PendingTokens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch

from tokenmill.attention import AttentionMetadata, StateMetadata, StepContext
from tokenmill.attention.backends import REFERENCE, AttentionBackend
from tokenmill.config import EngineConfig
from tokenmill.kv_cache.snapshot_copies import SnapshotTensors
from tokenmill.kv_cache.snapshots import StateStep
from tokenmill.kv_cache.spec import FullAttention, allocate_caches
from tokenmill.models.base import CausalLM
from tokenmill.multimodal.step import MultiModalStep, multimodal_step
from tokenmill.sampling import LogprobsTensors, Sampler, compute_logprobs
from tokenmill.sampling.greedy_head import GreedyHead
from tokenmill.sampling.in_flight import InFlightRow
from tokenmill.sampling.logits_processors import upload
from tokenmill.sampling.sampler import RowState, SamplingRow
from tokenmill.scheduler import ScheduledSeq, SchedulerOutput, StepTokens
from tokenmill.scheduler.draft_tree import accept, accepted_moves, path
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.worker.cuda_graphs import PaddedDecode, wants_cuda_graphs
from tokenmill.worker.draft_tree import move_kv, tree_attention
from tokenmill.worker.fast_path import FastPath, NativeDecodePath, cpu_fast_path
from tokenmill.worker.inputs import (
    HostIds,
    PendingTokens,
    PinnedStaging,
    StepColumns,
    build_step_inputs,
    record_event,
)
from tokenmill.worker.state_rollback import RollbackCopies, RollbackRows, StateRollback


class FeatureSink(Protocol):
    def record(
        self, seqs: Sequence[ScheduledSeq], query_start_loc: Sequence[int], hidden: torch.Tensor
    ) -> None:
        """The step's sequences, their row offsets, its final hidden states [T, hidden]."""
        ...

    def reorder(self, request_id: str, start: int, rows: Sequence[int]) -> None:
        """A draft tree was verified: positions start.. now hold the rows ``rows`` of what
        that step recorded from start on (the root, then the accepted nodes)."""
        ...


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of one chosen token plus the top-k alternatives at its position."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device (``ModelRunner.launch``), not yet waited for."""

    sched: SchedulerOutput
    """The step; its sequence i owns ``num_sample_rows`` rows of ``ids`` (from
    ``first_rows[i]``)."""
    cols: StepColumns
    first_rows: Sequence[int]
    ids: torch.Tensor | None
    """The sampled ids [R] on their way to the host (``HostIds.copy``); None: none sampled."""
    done: torch.cuda.Event | None
    """On CUDA, recorded after every copy to the host the step queued (ids, logprobs,
    prompt logprobs): what ``collect`` waits for. None: nothing copied, or CPU."""
    logprobs: LogprobsTensors | None
    prompt_logprobs: dict[str, tuple[int, list[int], LogprobsTensors]]
    rollback: StateRollback | None = None
    """The per-position recurrent states of its verifying sequences (``state_rollback``);
    None: no recurrent layer, or no drafts."""


@dataclass(frozen=True)
class ModelRunnerOutput:
    tokens: StepTokens
    """Per scheduled sequence, in order: its new tokens (accepted drafts, then the token
    sampled after them); [] when it did not sample. A decode step's are one flat list."""
    logprobs: list[list[TokenLogprobs]] | None
    """Aligned with ``tokens`` for sequences that asked for logprobs ([] for the others);
    None when no sequence of the step asked."""
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]]
    """request id -> (prompt position of the first entry, entries). Entry j scores
    prompt token start + j + 1 given everything before it."""


@dataclass(frozen=True)
class _Sampled:
    """A launched step's sampled ids [R] (device), its sequences, their first rows in the
    ids, and its columns: where the next step's placeholder tokens are read from."""

    ids: torch.Tensor
    sched: SchedulerOutput
    first_rows: Sequence[int]
    cols: StepColumns

    def steady_with(self, cols: StepColumns) -> bool:
        """This was a decode step (one row per sequence, in order) of the same requests,
        in the same order, as the step ``cols`` describes (a tuple comparison by
        identity): sequence i's token in flight is then row i of ``ids``."""
        mine = self.cols
        return mine.one_token_each and mine.all_sample and mine.requests == cols.requests


def allocate_kv_caches(
    model: CausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_slots: int = 1,
) -> list[torch.Tensor | None]:
    """One zeroed cache tensor per layer, as its spec says (``model.cache_specs()``): a
    [2, num_blocks, block_size, kv_heads, head_dim] page tensor for attention layers (in
    ``dtype``), a [num_slots, ...] state tensor for state-slot layers, None for none.

    Zeroed, not empty: padded positions are masked but still multiplied by 0.
    """
    specs = [
        dataclasses.replace(s, dtype=dtype) if isinstance(s, FullAttention) else s
        for s in model.cache_specs()
    ]
    return allocate_caches(specs, num_blocks, block_size, num_slots, device)


class ModelRunner:
    """Runs scheduled steps. ``backend`` (None: the reference) does the
    attention; ``decode`` (CUDA graphs, ``cuda_graphs.PaddedDecode``) takes the all-decode
    steps that fit one of its buckets, every other step runs eagerly here."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor | None],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        backend: AttentionBackend | None = None,
        decode: FastPath | None = None,
        state_slot: Callable[[str], int] | None = None,
        state_step: Callable[[list[str]], StateStep] | None = None,
        snapshots: SnapshotTensors | None = None,
    ) -> None:
        self.model = model
        self.state_slot = state_slot
        """Request id -> its state slot (``KVCacheCoordinator.state_slot``) when the model
        has state-slot layers (``kv_cache/spec.py``); None: attention layers only."""
        self.state_step = state_step
        """With a recurrent-state snapshot pool (``snapshots``): the step's slots and
        snapshot copies (``KVCacheCoordinator.state_step``), asked once per step instead
        of ``state_slot``."""
        self.snapshots = snapshots
        self._end_saves: StateStep | None = None
        """The step's chunk-end snapshots, copied once its forward ran."""
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.backend = backend or REFERENCE
        self.decode = decode
        self.mm: MultiModalStep | None = None
        """Encoder outputs and M-RoPE positions of steps with media; None: text-only model."""
        self.staging = PinnedStaging(device)
        self.host_ids = HostIds(device)
        self._last_sampled: _Sampled | None = None
        """The latest launched step's sampled ids (device) and where each sequence's are."""
        self.tap: FeatureSink | None = None
        """Set by a speculative head's proposer (EAGLE-3, MTP): handed every step's
        features (``spec_decode/features.FeatureTap``); None: nothing is kept."""
        self.rollback_rows: RollbackRows | None = None
        """With recurrent layers and speculative decoding: where verify steps keep their
        per-position states (``state_rollback.py``); None: no rollback (attention only)."""
        self._rollback: StateRollback | None = None
        """The step being launched's rollback rows, handed to its ``LaunchedStep``."""
        self.greedy_head = GreedyHead.of(model, device)
        """The model's head and argmax in one call for all-greedy steps on CPU; None: the
        logits are always computed in full."""
        self.mirror_rollback: Callable[[RollbackCopies], None] | None = None
        """Set by a parallel executor: each verify step's rollback copies, which the
        workers make on their own shards of the state (``distributed/worker.py``)."""

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Queue the step's forward pass and sampling on the device and the copy of the
        sampled ids back; returns without waiting (on CUDA) for any of it."""
        cols = StepColumns.of(sched, self.block_size)  # made once per step
        pending = self._pending_tokens(sched, cols)
        hidden, qsl = self._forward(sched, pending, cols)
        if self._end_saves is not None:  # states at chunk ends -> snapshot rows
            assert self.snapshots is not None
            self.snapshots.save(self._end_saves, self.kv_caches)
            self._end_saves = None
        if self.tap is not None:  # a speculative head reads the target's features
            self.tap.record(sched.seqs, qsl, hidden)
        first_rows, sample_rows, rows = _sample_rows(sched, qsl, pending, cols)
        sampled, lp = self._sample(rows, sample_rows, hidden) if rows else (None, None)
        # A decode step scores no prompt token: each sequence is past its prompt.
        decode = cols.one_token_each and cols.all_sample
        prompt_lp = {} if decode else self._prompt_logprobs(cols, qsl, hidden)
        pinned = self.host_ids.pinned
        if pinned:  # queued before the step's event, so collect's wait covers them
            lp = _copy_to_host(lp)
            prompt_lp = {r: (a, t, _to_pinned(x)) for r, (a, t, x) in prompt_lp.items()}
        self._last_sampled = None if sampled is None else _Sampled(sampled, sched, first_rows, cols)
        ids = self.host_ids.copy(sampled) if sampled is not None else None
        # A step of prompt chunks samples nothing, yet may copy prompt logprobs back.
        done = record_event() if pinned and (ids is not None or prompt_lp) else None
        rollback = self._rollback
        if rollback is not None:  # a verify step on recurrent layers: its rows go with it
            self._rollback = None
        return LaunchedStep(sched, cols, first_rows, ids, done, lp, prompt_lp, rollback)

    def _forward(
        self, sched: SchedulerOutput, pending: PendingTokens | None, cols: StepColumns
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """hidden [T, hidden] of the step's tokens and the query offsets (B+1) of its
        sequences: through the padded decode path (CUDA graphs) when it takes the step."""
        if not cols.one_token_each and self.mm is None and cols.seq.parents:  # draft trees
            return self._forward_tree(sched, pending, cols)
        if self.decode is not None and self.decode.takes(sched, cols):
            hidden = self.decode.run(sched, sched.tables, pending, cols)  # [T, hidden]
            b = len(cols.requests)
            if b == hidden.shape[0]:  # one token each: row i = sequence i
                return hidden, tuple(range(b + 1))
            return hidden, tuple(accumulate(cols.num_new.tolist(), initial=0))
        inputs = build_step_inputs(
            sched, self.block_size, self.staging, sched.tables, pending, cols
        )
        ctx, positions = self._ctx(inputs.meta, cols.requests, cols), inputs.positions
        if self.mm is not None:  # a model with a media encoder (multimodal/step.py)
            positions, ctx = self.mm.prepare(sched.seqs, ctx, positions)
        hidden = self.model(inputs.input_ids, positions, ctx)
        return hidden, inputs.meta.query_start_loc

    def _forward_tree(
        self, sched: SchedulerOutput, pending: PendingTokens | None, cols: StepColumns
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``_forward`` of a step with draft trees: node rows at their depth's rotary
        position, seeing their path (``draft_tree.tree_attention``); the whole-layer CPU
        path takes it when every sequence is decoding or verifying."""
        seqs = sched.seqs
        inputs = build_step_inputs(
            sched, self.block_size, self.staging, sched.tables, pending, cols
        )
        positions, meta = tree_attention(seqs, inputs.positions, inputs.meta)
        fast = self.decode
        if isinstance(fast, NativeDecodePath) and meta.is_all_decode:
            ctx = StepContext(meta, self.kv_caches, fast.backend)
            hidden = fast.decode(inputs.input_ids, positions, ctx)
        else:
            hidden = self.model(inputs.input_ids, positions, self._ctx(meta, cols.requests))
        return hidden, inputs.meta.query_start_loc

    def _settle_trees(self, step: LaunchedStep, accepted: dict[int, list[int]]) -> None:
        """Move the accepted tree nodes' K/V to the positions they now hold (before the
        scheduler commits or rolls back), and their features with them."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.block_size
        for i, nodes in accepted.items():
            s = step.sched.seqs[i]
            if s.request.status is not RequestStatus.RUNNING:
                continue  # preempted or ended while in flight: its blocks are not its own
            root = s.end - len(s.draft_parents) - 1
            table = s.block_table
            for a, b in accepted_moves(root, nodes):
                src.append(table[a // bs] * bs + a % bs)
                dst.append(table[b // bs] * bs + b % bs)
            if self.tap is not None:
                self.tap.reorder(s.request.request_id, root, [0, *(1 + j for j in nodes)])
        move_kv(self.kv_caches, src, dst)

    def _sample(
        self, rows: Sequence[SamplingRow], sample_rows: list[int], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """Logits of hidden's rows ``sample_rows`` -> (ids [R], logprobs); ``rows`` are
        their sampling states (a request, or a request with drafts appended)."""
        states, device = hidden, hidden.device  # every row samples (a decode step): no gather
        if len(sample_rows) != hidden.shape[0]:
            states = hidden.index_select(0, upload(sample_rows, torch.int64, device))
        head = self.greedy_head
        if head is not None and head.takes(states) and self.sampler.argmax_only(rows, device):
            return head(states), None  # the tokens without the logits (greedy_head.py)
        logits = self.model.compute_logits(states)
        out = self.sampler(logits, rows, in_place=True)
        return out.token_ids, out.logprobs

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's copies to the host (the step's one synchronisation)."""
        if step.done is not None:
            step.done.synchronize()
        token_list: list[int] = step.ids.tolist() if step.ids is not None else []
        accepted: dict[int, list[int]] = {}
        out = _to_host(step, token_list, accepted)
        if accepted:
            self._settle_trees(step, accepted)
        if step.rollback is not None:  # recurrent states back to the accepted drafts
            self._roll_back_states(step, step.rollback, out.tokens)
        return out

    def _roll_back_states(self, step: LaunchedStep, rollback: StateRollback,
                          tokens: StepTokens) -> None:  # fmt: skip
        """Each verifying sequence's slot gets the state after its accepted drafts (before
        the scheduler truncates its blocks); one preempted or ended while in flight keeps
        nothing (its slot is not its own any more)."""
        assert self.state_slot is not None and self.rollback_rows is not None
        requests = step.cols.requests
        slots = [self.state_slot(r.request_id) for r in requests]
        accepted = [
            len(new) - 1 if r.status is RequestStatus.RUNNING and new else None
            for r, new in zip(requests, tokens)
        ]  # fmt: skip
        copies = rollback.apply(slots, accepted, self.kv_caches)
        if self.mirror_rollback is not None:
            self.mirror_rollback(copies)
        self.rollback_rows.give(rollback.tensors)

    def _pending_tokens(self, sched: SchedulerOutput, cols: StepColumns) -> PendingTokens | None:
        """The step's input tokens that the previous step is still sampling (each the
        last row its sequence sampled there: it has no drafts)."""
        waiting = cols.pending
        if not waiting:
            return None
        last = self._last_sampled
        assert last is not None, "a pending token without a step in flight"
        if last.steady_with(cols):  # the same decode batch: row i = i
            return PendingTokens(last.ids, waiting, waiting)
        was = last.cols.seq
        row_of = {  # the batch changed: look each one up
            r.request_id: last.first_rows[j]
            for j, (r, samples) in enumerate(zip(was.requests, was.samples)) if samples
        }  # fmt: skip
        rows = tuple(row_of[cols.requests[i].request_id] for i in waiting)
        return PendingTokens(last.ids, tuple(waiting), rows)

    def _ctx(self, meta: AttentionMetadata, requests: Sequence[Request] = (),
             cols: StepColumns | None = None) -> StepContext:  # fmt: skip
        """The step context; with state-slot layers, each sequence's slot in it (and, for
        a step verifying drafts, the rows its per-position states go to)."""
        keeps: tuple[tuple[tuple[int, int], ...], ...] = ()
        rows: list[torch.Tensor | None] | None = None
        if self.rollback_rows is not None and cols is not None and cols.seq.drafts:
            self._rollback = self.rollback_rows.plan(
                cols.seq.drafts, cols.seq.num_new, len(requests)
            )
            if self._rollback is not None:
                keeps, rows = self._rollback.run_keeps, self._rollback.tensors
        if self.state_step is not None:  # a snapshot pool: restores first, then the forward
            assert self.snapshots is not None
            step = self.state_step([r.request_id for r in requests])
            self.snapshots.restore(step, self.kv_caches)
            self._end_saves = step if step.saves_after else None
            state = StateMetadata.build(step.slots, meta, step.run_saves, self.snapshots.tensors,
                                        keeps, rows)  # fmt: skip
            return StepContext(meta, self.kv_caches, self.backend, state)
        if self.state_slot is None:
            return StepContext(meta, self.kv_caches, self.backend)
        slots = [self.state_slot(r.request_id) for r in requests]
        state = StateMetadata.build(slots, meta, run_keeps=keeps, rollback=rows)
        return StepContext(meta, self.kv_caches, self.backend, state)

    def _prompt_logprobs(
        self, cols: StepColumns, qsl: tuple[int, ...], hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[int], LogprobsTensors]]:
        """Score the prompt tokens this chunk predicts, for requests that asked."""
        result: dict[str, tuple[int, list[int], LogprobsTensors]] = {}
        for i, req in enumerate(cols.requests):
            k = req.params.prompt_logprobs
            if k is None:
                continue
            start = int(cols.starts[i])
            last = min(start + int(cols.num_new[i]), req.num_prompt_tokens - 1)
            if start >= last:  # no position of this chunk predicts a prompt token
                continue
            row0 = qsl[i]
            logits = self.model.compute_logits(hidden[row0 : row0 + last - start])
            targets = upload(req.prompt_token_ids[start + 1 : last + 1], torch.int64, self.device)
            lp = compute_logprobs(logits, k, targets)
            result[req.request_id] = (start, req.prompt_token_ids[start + 1 : last + 1], lp)
        return result


def make_runner(
    config: EngineConfig,
    model: CausalLM,
    kv_caches: list[torch.Tensor | None],
    device: torch.device,
    sampler: Sampler,
    max_model_len: int,
    state_slot: Callable[[str], int] | None = None,
    state_step: Callable[[list[str]], StateStep] | None = None,
    snapshots: SnapshotTensors | None = None,
) -> ModelRunner:
    """The engine's runner: the attention backend the model was built with (chosen once at
    load, ``layers/ops.py``), and one fast path (``fast_path.FastPath``): on CUDA (unless
    ``enforce_eager``) decode graphs for a capturable backend, captured here, up front; on
    CPU the whole-layer native decode when the model runs it. ``state_slot``: the KV
    coordinator's slot lookup for models with state-slot layers (they run eagerly: the
    fast paths carry no state slots); ``state_step`` / ``snapshots`` its step lookup and
    the snapshot tensors when the model keeps recurrent-state snapshots."""
    backend = model.ops.backend
    decode: FastPath | None = cpu_fast_path(model, kv_caches, config.block_size, device)
    mm = multimodal_step(model, config.mm_encoder_cache_bytes)
    if state_slot is not None or mm is not None:  # fast paths: no slots, 1-D positions
        decode = None
    elif wants_cuda_graphs(device, backend, config.enforce_eager):
        graphs = PaddedDecode(
            model, kv_caches, config.block_size, max_model_len, config.max_num_seqs, device, backend
        )
        with torch.inference_mode():
            graphs.capture_all()
        decode = graphs
    runner = ModelRunner(
        model, kv_caches, config.block_size, device, sampler, backend, decode, state_slot,
        state_step, snapshots,
    )  # fmt: skip
    runner.mm = mm
    if state_slot is not None and config.speculative is not None:  # drafts on recurrent layers
        runner.rollback_rows = RollbackRows(model.cache_specs(), kv_caches)
    return runner


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


def _to_pinned(lp: LogprobsTensors) -> LogprobsTensors:
    """``_copy_to_host`` of tensors that are there."""
    out = _copy_to_host(lp)
    assert out is not None
    return out


def _copy_to_host(lp: LogprobsTensors | None) -> LogprobsTensors | None:
    """Queue the copies of logprob tensors to (pinned) host memory without waiting: read
    once the step's event has passed, they cost no stream synchronize."""
    if lp is None:
        return None
    return LogprobsTensors(
        *(t.to("cpu", non_blocking=True)
          for t in (lp.sampled_logprob, lp.sampled_rank, lp.top_ids, lp.top_logprobs))
    )  # fmt: skip


def _sample_rows(
    sched: SchedulerOutput,
    qsl: tuple[int, ...],
    pending: PendingTokens | None,
    cols: StepColumns,
) -> tuple[Sequence[int], list[int], Sequence[SamplingRow]]:
    """(first sampled row per sequence, the hidden rows that sample, their sampling states).

    A sequence samples at its last token and, with drafts, at each draft's position too
    (row j scores the token after the drafts before j, so its state has them appended:
    penalties and min_tokens then see what a plain decode would have seen). A sequence
    whose latest token is still in flight (``pending``) and whose sampling reads its
    tokens (penalties) gets an ``InFlightRow``: that token is read on the device."""
    requests, c = cols.requests, cols.seq
    in_flight = {}
    if pending is not None:
        in_flight = {i: row for i, row in zip(pending.seqs, pending.rows)
                     if requests[i].params.uses_penalties}  # fmt: skip
    b = len(requests)
    if not in_flight and cols.one_token_each and cols.all_sample:  # decode: row i = sequence i
        every = range(b)
        return every, list(every), requests
    if not in_flight and not c.drafts:  # the common step: one row per sampler
        if cols.all_sample:
            return range(b), [qsl[i + 1] - 1 for i in range(b)], requests
        sampling = [i for i, samples in enumerate(c.samples) if samples]
        first = tuple(accumulate(c.samples, initial=0))[:-1]
        return first, [qsl[i + 1] - 1 for i in sampling], [requests[i] for i in sampling]
    first_rows: list[int] = []
    hidden_rows: list[int] = []
    states: list[SamplingRow] = []
    for i, req in enumerate(requests):
        first_rows.append(len(states))
        if not c.samples[i]:
            continue
        drafts = c.drafts.get(i, ())
        last = qsl[i + 1] - 1
        if not drafts:
            hidden_rows.append(last)
            if i in in_flight:
                assert pending is not None
                states.append(InFlightRow(req, pending.source, in_flight[i]))
            else:
                states.append(req)  # the request is its own sampling state: no object per row
            continue
        hidden_rows.extend(range(last - len(drafts), last + 1))
        states.append(req)
        parents = c.parents.get(i, ())
        for j in range(1, len(drafts) + 1):  # row j scores the token after draft j - 1
            before = [drafts[a] for a in path(parents, j - 1)] if parents else drafts[:j]
            outputs = [*req.output_token_ids, *before]
            states.append(RowState(req.params, req.prompt_token_ids, outputs, req.generator,
                                   req.eos_token_ids, req.structured))  # fmt: skip
    return tuple(first_rows), hidden_rows, states


def verify_drafts(drafts: tuple[int, ...], sampled: list[int]) -> list[int]:
    """New tokens of a sequence from its sampled rows: each draft is accepted while it
    equals what was sampled at its position; the first sample that differs (or the one
    after the last draft) ends the list. Each token is drawn from the model's distribution
    given the tokens before it, so the output distribution is that of plain decoding."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return sampled[: j + 1]
    return sampled


def _to_host(
    step: LaunchedStep, token_list: list[int], accepted: dict[int, list[int]] | None = None
) -> ModelRunnerOutput:
    """Host-side outputs once the step's copies are on the host (``LaunchedStep.done``, the
    step's synchronisation point). ``accepted`` gets, per draft-tree sequence, the nodes
    its output took."""
    c = step.cols.seq
    rows: list[list[int]] | None = None  # sampled rows of each output token (trees)
    if len(token_list) == len(c.requests) and not c.drafts:  # one each (decode)
        tokens = StepTokens(flat=token_list)
    else:
        lists: list[list[int]] = []
        rows = []
        for i, row in enumerate(step.first_rows):
            drafts = c.drafts.get(i, ())
            sampled = token_list[row : row + len(drafts) + 1] if c.samples[i] else []
            parents = c.parents.get(i)
            if parents:
                nodes = accept(drafts, parents, sampled)
                used = [0, *(1 + j for j in nodes)]
                lists.append([*(drafts[j] for j in nodes), sampled[used[-1]]])
                rows.append(used)
                if accepted is not None:
                    accepted[i] = nodes
                continue
            new = verify_drafts(drafts, sampled) if drafts else sampled
            lists.append(new)
            rows.append(list(range(len(new))))
        tokens = StepTokens(lists)
    logprobs = None
    if step.logprobs is not None:
        entries = _entries(step.logprobs, token_list)
        logprobs = []
        for i, (req, row, new) in enumerate(zip(c.requests, step.first_rows, tokens)):
            k = req.params.logprobs
            used = rows[i] if rows is not None else list(range(len(new)))
            logprobs.append(
                [] if k is None else
                [TokenLogprobs(e.token_id, e.logprob, e.rank, e.top[:k])
                 for e in (entries[row + r] for r in used)]
            )  # fmt: skip
    prompt = {
        rid: (start, _entries(plp, targets))
        for rid, (start, targets, plp) in step.prompt_logprobs.items()
    }
    return ModelRunnerOutput(tokens, logprobs, prompt)
