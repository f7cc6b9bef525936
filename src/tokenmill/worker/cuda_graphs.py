"""All-decode steps through static, padded buffers, replayed as CUDA graphs.

A decode step of B sequences runs as a bucket of N >= B rows (N in ``decode_buckets``):
rows B..N-1 are padding (token 0 at position 0, cache slot -1, context length 0), which
a capturable backend skips when storing K/V and answers with zeros. Every input lives
in one static device buffer, so the graph captured for N reads this step's values. The
block tables are padded to a fixed width, max_model_len / block_size blocks.

Sampling stays outside the graph: the runner takes the hidden rows 0..B-1.

With ``capture=False`` the same buffers run the model eagerly (CPU tests of the
padding and bucketing; a backend that reads the Python-side lengths sees the real ones).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention import AttentionMetadata, ForwardContext
from tokenmill.attention.backends import REFERENCE, AttentionBackend
from tokenmill.kv_cache.block_table import BlockTableArray
from tokenmill.models.base import CausalLM
from tokenmill.scheduler import ScheduledSeq
from tokenmill.worker.inputs import (
    PendingTokens,
    PinnedStaging,
    StepColumns,
    StepLike,
    fill_block_tables,
    known_tokens,
    packed_numel,
    records,
    sections,
)

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Batch sizes a graph is captured for (capped by max_num_seqs, which is always one)."""
PAD_SLOT = -1
"""Cache slot of a padding row: its K/V is not stored."""


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """(1, 2, 4, ..., cap) with cap = min(max_num_seqs, 512); bigger batches run eagerly."""
    cap = min(max_num_seqs, BUCKETS[-1])
    return (*(b for b in BUCKETS if b < cap), cap)


def wants_cuda_graphs(device: torch.device, backend: object, enforce_eager: bool) -> bool:
    """Graphs need CUDA, a backend that reads only tensors (``supports_cuda_graphs``), and
    ``enforce_eager`` off. The reference backend sizes its work from Python lengths: never."""
    return (
        device.type == "cuda"
        and not enforce_eager
        and bool(getattr(backend, "supports_cuda_graphs", False))
    )


def _rows(seqs: tuple[ScheduledSeq, ...]) -> int:
    return sum(s.num_new_tokens for s in seqs)


def _verifies_chains(seqs: tuple[ScheduledSeq, ...], cols: StepColumns | None) -> bool:
    """Every sequence brings its last known token and its draft chain, nothing in flight."""
    if cols is not None and cols.pending:
        return False
    return all(
        s.samples and not s.draft_parents and s.num_new_tokens == 1 + len(s.draft_token_ids)
        for s in seqs
    )


@dataclass(frozen=True)
class _Views:
    """Bucket N's static inputs (fixed addresses): views of the shared flat buffer, and the
    first N rows of the static block tables."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]
    seq_lens: torch.Tensor  # [N]
    qsl: torch.Tensor  # [N + 1]: 0..N, one token per row
    tables: torch.Tensor  # [N, W]


class PaddedDecode:
    """Runs all-decode batches of up to ``buckets[-1]`` sequences on static buffers."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor | None],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        backend: AttentionBackend | None = None,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // block_size)
        self.buckets = decode_buckets(max_num_seqs)
        self.backend = backend or REFERENCE
        self.capture = capture
        self.staging = PinnedStaging(device)
        n = self.buckets[-1]
        # Bucket N's step arrives as one packed copy (``inputs.sections``):
        # [ids N | pos N | slots N | seq_lens N | qsl N+1] land in place in ``flat``, where
        # the graph reads them; then the used columns of the real rows' block tables
        # [B, W_used] and the pending tokens' rows (2 x at most N) land after them and are
        # moved on the device before the replay: the tables into ``tables`` [N, W].
        self.flat = torch.zeros(
            packed_numel(self._head_sizes(n)) + packed_numel([n * self.width, n, n]),
            dtype=torch.int64, device=device,
        )  # fmt: skip
        self.tables = torch.zeros((n, self.width), dtype=torch.int64, device=device)
        """Static block tables. Only the columns a step uses are written: entries past a
        row's length (or in a padding row) may be stale, and no kernel reads them."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        """Bucket -> the graph's hidden output [N, hidden] (rewritten by every replay)."""
        self.capture_seconds: dict[int, float] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.disabled = False
        """Set when a capture failed: decode steps then run on the normal eager path."""

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows; None when none does."""
        if self.disabled:
            return None
        return next((b for b in self.buckets if b >= batch), None)

    def takes(self, step: StepLike, cols: StepColumns | None = None) -> bool:
        """An all-decode step (one new token per sequence) that fits a bucket; or a step
        verifying draft chains (each sequence: its last token and its drafts, none in
        flight), run as one decode row per token, whose rows fit one."""
        cols = cols or StepColumns.of(step, self.block_size)
        if cols.one_token_each:
            return self.bucket_for(len(cols.requests)) is not None
        seqs = records(step)
        return _verifies_chains(seqs, cols) and self.bucket_for(_rows(seqs)) is not None

    def run(
        self,
        step: StepLike,
        tables: BlockTableArray | None = None,
        pending: PendingTokens | None = None,
        cols: StepColumns | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of the step's B one-token sequences (``takes`` holds);
        ``tables``: the scheduler's block-table array (None: the sequences' lists);
        ``pending``: input tokens still on the device (asynchronous scheduling)."""
        cols = cols or StepColumns.of(step, self.block_size)
        rows = len(cols.requests) if cols.one_token_each else _rows(records(step))
        n = self.bucket_for(rows)
        assert n is not None
        # Capture first: it fills the buffers with padding rows of its own.
        graph = (self.graphs.get(n) or self._capture(n)) if self.capture else None
        views = self._views(n)
        if cols.one_token_each:
            self._upload(step, n, tables, pending, cols)
            lens = cols.starts + 1
        else:  # a verify step: its tokens as decode rows (graphs see only row tensors)
            assert pending is None
            lens = self._upload_rows(records(step), n, tables, cols)
        if graph is None:  # eager through the same buffers (also after a failed capture)
            seq_lens = tuple(lens.tolist()) + (0,) * (n - rows)
            hidden = self.model(views.input_ids, views.positions, self._ctx(views, seq_lens))
            return hidden[:rows]
        graph.replay()
        return self.outputs[n][:rows]

    def _upload_rows(
        self,
        seqs: tuple[ScheduledSeq, ...],
        n: int,
        tables: BlockTableArray | None,
        cols: StepColumns,
    ) -> np.ndarray:
        """A verify step into bucket n: row r is one token (a sequence's last known token
        or one of its drafts) at its position, seeing its sequence's blocks up to itself
        (``fast_path.per_token_rows``); returns the rows' context lengths."""
        b, bs, t = len(seqs), self.block_size, _rows(seqs)
        used = cols.width
        sizes = [*self._head_sizes(n), t * used, 0, 0]
        host = self.staging.host(packed_numel(sizes))
        ids, pos, slots, lens, qsl, flat_tables, _, _ = sections(host, sizes)
        for part in (ids, pos, lens):
            part[t:] = 0
        seq_tables = np.zeros((b, used), dtype=np.int64)
        fill_block_tables(seqs, tables, seq_tables, cols.table_rows)
        owner = np.repeat(np.arange(b), cols.num_new)  # [T]: each row's sequence
        first = np.concatenate(([0], np.cumsum(cols.num_new)[:-1]))
        ids[:t] = [tok for s in seqs for tok in known_tokens(s)]
        pos[:t] = np.arange(t) - first[owner] + cols.starts[owner]
        table = flat_tables.reshape(t, used)
        table[:] = seq_tables[owner]
        lens[:t] = pos[:t] + 1
        qsl[:] = np.arange(n + 1)
        slots[:t] = table[np.arange(t), pos[:t] // bs] * bs + pos[:t] % bs
        slots[t:] = PAD_SLOT
        flat = self.staging.send(host, out=self.flat[: host.shape[0]])
        tables_d = sections(flat, sizes)[5]
        self.tables[:t, :used].copy_(tables_d.view(t, used))
        return lens[:t].copy()

    def capture_all(self) -> float:
        """Capture every bucket, largest first (smaller ones reuse its memory pool); the
        total seconds are logged and returned."""
        start = time.perf_counter()
        for n in reversed(self.buckets):
            if n not in self.graphs and self._capture(n) is None:
                break
        total = time.perf_counter() - start
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (%s) in %.2f s",
            len(self.graphs), ",".join(map(str, sorted(self.graphs))), total,
        )  # fmt: skip
        return total

    def _upload(
        self,
        step: StepLike,
        n: int,
        tables: BlockTableArray | None,
        pending: PendingTokens | None,
        cols: StepColumns | None = None,
    ) -> None:
        """Bucket n's packed inputs to the static buffers: real rows, then padding rows;
        pending input tokens are filled in on the device, before the replay. Only the
        block-table columns the step uses go up: with max_model_len 131072 the full
        [256, 8192] tables would be 16.8 MB a step."""
        bs = self.block_size
        if cols is None and step:  # () from capture: padding rows only
            cols = StepColumns.of(step, bs)
        b = len(cols.requests) if cols is not None else 0
        used = cols.width if cols is not None else 0  # block-table columns in use
        k = len(pending.seqs) if pending is not None else 0
        sizes = [*self._head_sizes(n), b * used, k, k]
        host = self.staging.host(packed_numel(sizes))
        ids, pos, slots, lens, qsl, flat_tables, token_rows, src_rows = sections(host, sizes)
        for part in (ids, pos, lens):
            part[b:] = 0  # padding rows: token 0 at position 0, context 0
        table = flat_tables.reshape(b, used)
        if cols is not None:
            assert cols.decode_ids is not None, "one token per sequence"
            ids[:b] = cols.decode_ids
            pos[:b] = cols.starts
            fill_block_tables(step, tables, table, cols.table_rows)
        lens[:b] = pos[:b] + 1
        qsl[:] = np.arange(n + 1)
        slots[:b] = table[np.arange(b), pos[:b] // bs] * bs + pos[:b] % bs
        slots[b:] = PAD_SLOT
        if pending is not None:
            token_rows[:] = pending.seqs  # one token per row: the row is the sequence
            src_rows[:] = pending.rows
        flat = self.staging.send(host, out=self.flat[: host.shape[0]])
        *_, tables_d, rows_d, src_d = sections(flat, sizes)
        if used:
            self.tables[:b, :used].copy_(tables_d.view(b, used))
        if pending is not None:
            pending.fill(flat[:n], rows_d, src_d)

    @staticmethod
    def _head_sizes(n: int) -> list[int]:
        """Sections of bucket n's inputs read in place: ids, positions, slots, lengths, qsl."""
        return [n, n, n, n, n + 1]

    def _views(self, n: int) -> _Views:
        ids, pos, slots, lens, qsl = sections(self.flat, self._head_sizes(n))
        return _Views(ids, pos, slots, lens, qsl, self.tables[:n])

    def _ctx(self, views: _Views, seq_lens: tuple[int, ...]) -> ForwardContext:
        n = views.input_ids.numel()
        meta = AttentionMetadata(
            slot_mapping=views.slots,
            query_start_loc=tuple(range(n + 1)),
            seq_lens=seq_lens,
            block_tables=views.tables,
            block_size=self.block_size,
            seq_lens_tensor=views.seq_lens,
            query_start_loc_tensor=views.qsl,
        )
        return ForwardContext(meta, self.kv_caches, self.backend)

    def _capture(self, n: int) -> torch.cuda.CUDAGraph | None:
        """Record bucket n's forward; on failure log it and turn the padded path off."""
        start = time.perf_counter()
        views = self._views(n)
        # Every row is padding while warming up and capturing: nothing reaches the cache.
        self._upload((), n, None, None)
        # Python-side lengths are placeholders here: a captured backend reads only tensors.
        ctx = self._ctx(views, (self.max_model_len,) * n)
        try:
            torch.cuda.synchronize()
            for _ in range(2):  # compiles Triton kernels, lets cuBLAS pick its algorithms
                self.model(views.input_ids, views.positions, ctx)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.model(views.input_ids, views.positions, ctx)
            torch.cuda.synchronize()
        except Exception:
            logger.exception("CUDA graph capture failed for batch size %d: decoding eagerly", n)
            self.disabled = True
            return None
        self.graphs[n], self.outputs[n] = graph, out
        self.capture_seconds[n] = time.perf_counter() - start
        logger.debug(
            "captured the decode graph of batch size %d in %.3f s", n, self.capture_seconds[n]
        )
        return graph
