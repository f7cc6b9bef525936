"""The padded decode path (the CUDA-graph buffers) run eagerly on CPU with a tiny model.

The reference backend sizes its work from the Python-side lengths and stores K/V for
every row, so it can not take padding rows; ``PadSkippingBackend`` gives it only the real
rows and answers padding rows with zeros, as a capturable backend does. Everything
else (embedding, matmuls, norms, rotary of the padding rows) runs on the padded batch.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention import AttentionMetadata
from tokenmill.attention.backends import REFERENCE, AttentionBackend, AttentionImpl, AttentionParams
from tokenmill.scheduler import ScheduledSeq
from tokenmill.scheduler.request import Request
from tokenmill.worker.cuda_graphs import PAD_SLOT, PaddedDecode, decode_buckets, wants_cuda_graphs
from tokenmill.worker.model_runner import ModelRunner

MAX_MODEL_LEN, BS = 64, 4


class PadSkippingBackend(AttentionBackend):
    """Reference attention of the leading real rows; trailing padding rows (slot -1,
    seq_len 0) store nothing and get zeros. Records the row counts it saw."""

    name = "pad-skipping"

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []  # (rows, real rows) per layer call

    def bind(self, params: AttentionParams) -> AttentionImpl:
        return _PadSkipping(params, self.seen)


class _PadSkipping(AttentionImpl):
    def __init__(self, params: AttentionParams, seen: list[tuple[int, int]]) -> None:
        super().__init__(params)
        self.seen = seen
        self.reference = REFERENCE.bind(params)

    def forward(self, q, kv, kv_cache, meta):
        real = int((meta.slot_mapping >= 0).sum())
        rows = q.shape[0]
        self.seen.append((rows, real))
        assert meta.slot_mapping[real:].eq(PAD_SLOT).all()  # padding is trailing
        assert meta.seq_lens_tensor[real:].eq(0).all() and not any(meta.seq_lens[real:])
        if real == rows:
            return self.reference.forward(q, kv, kv_cache, meta)
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping[:real],
            query_start_loc=meta.query_start_loc[: real + 1],
            seq_lens=meta.seq_lens[:real],
            block_tables=meta.block_tables[:real],
            block_size=meta.block_size,
            seq_lens_tensor=meta.seq_lens_tensor[:real],
        )
        out = torch.zeros_like(q)
        out[:real] = self.reference.forward(q[:real], kv[:real], kv_cache, sub)
        return out


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=96,
             block_size=BS, enable_prefix_caching=False, max_num_seqs=8) as llm:  # fmt: skip
        yield llm


def install_padded_runner(llm: LLM, max_num_seqs: int) -> tuple[PaddedDecode, PadSkippingBackend]:
    """Swap the engine's runner for one whose decode steps go through PaddedDecode."""
    old = llm.engine.runner
    backend = PadSkippingBackend()
    decode = PaddedDecode(
        old.model,
        old.kv_caches,
        BS,
        MAX_MODEL_LEN,
        max_num_seqs,
        old.device,
        backend,
        capture=False,
    )
    llm.engine.runner = ModelRunner(
        old.model, old.kv_caches, BS, old.device, old.sampler, backend, decode
    )
    return decode, backend


def count_runs(decode: PaddedDecode, monkeypatch) -> list[int]:
    """Batch sizes of the steps PaddedDecode ran."""
    sizes: list[int] = []
    run = decode.run

    def spy(step, tables=None, pending=None, cols=None):
        sizes.append(len(cols.requests) if cols is not None else len(step))
        return run(step, tables, pending, cols)

    monkeypatch.setattr(decode, "run", spy)
    return sizes


PROMPTS = [[5, 9, 14, 3], [7] * 11, [21, 22, 23, 24, 25, 26], [40], [33, 2, 8, 19, 4, 4, 4]]
# Different lengths end the requests at different steps: decode batches of 5, 4, 3, 2, 1.
PARAMS = [SamplingParams(max_tokens=n, temperature=0, logprobs=2, ignore_eos=True)
          for n in (3, 12, 7, 9, 5)]  # fmt: skip


def generate(llm: LLM):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return [o.outputs[0] for o in outs]


def assert_same(padded, eager):
    for p, e in zip(padded, eager):
        assert p.token_ids == e.token_ids
        for lp, le in zip(p.logprobs, e.logprobs):
            assert lp.keys() == le.keys()
            for tok in lp:
                assert lp[tok].logprob == pytest.approx(le[tok].logprob, abs=1e-5)


def test_buckets():
    assert decode_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert decode_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert decode_buckets(1) == (1,)
    assert decode_buckets(4096)[-1] == 512


def test_graphs_only_for_capturable_backends_on_cuda():
    class Capturable:
        supports_cuda_graphs = True

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert wants_cuda_graphs(cuda, Capturable(), enforce_eager=False)
    assert not wants_cuda_graphs(cuda, Capturable(), enforce_eager=True)
    assert not wants_cuda_graphs(cuda, REFERENCE, enforce_eager=False)
    assert not wants_cuda_graphs(cpu, Capturable(), enforce_eager=False)


def test_padded_decode_matches_eager(llm, monkeypatch):
    old = llm.engine.runner
    eager = generate(llm)
    try:
        decode, backend = install_padded_runner(llm, max_num_seqs=8)
        sizes = count_runs(decode, monkeypatch)
        padded = generate(llm)
    finally:
        llm.engine.runner = old
    assert_same(padded, eager)
    # Every step after the prefill is all-decode: batches 5 (x2), 4, 3, 2, 1 in order.
    assert sizes == sorted(sizes, reverse=True) and set(sizes) == {5, 4, 3, 2, 1}
    assert sum(sizes) == sum(p.max_tokens - 1 for p in PARAMS)
    # Padded to the buckets 8, 4, 4, 2, 1 (5 -> 8, 3 -> 4); the prefill step was unpadded.
    padded_rows = {rows for rows, real in backend.seen if rows != real}
    assert padded_rows == {8, 4}
    assert (sum(len(p) for p in PROMPTS), sum(len(p) for p in PROMPTS)) in backend.seen


def test_padded_decode_takes_pending_tokens_with_async_scheduling(llm, monkeypatch):
    """Asynchronous scheduling: each decode step's input tokens are the previous step's
    sampled ids, filled in on the device after the packed copy; same outputs."""
    old = llm.engine.runner
    eager = generate(llm)
    monkeypatch.setattr(llm.engine, "overlap", True)
    try:
        decode, _ = install_padded_runner(llm, max_num_seqs=8)
        pending = []
        run = decode.run

        def spy(seqs, tables=None, p=None, cols=None):
            pending.append(0 if p is None else len(p.seqs))
            return run(seqs, tables, p, cols)

        monkeypatch.setattr(decode, "run", spy)
        padded = generate(llm)
    finally:
        llm.engine.runner = old
    assert_same(padded, eager)
    assert max(pending) == 5  # the 5-row steps took all their inputs from the device


def test_batches_over_the_largest_bucket_run_eagerly(llm, monkeypatch):
    old = llm.engine.runner
    eager = generate(llm)
    try:
        decode, backend = install_padded_runner(llm, max_num_seqs=2)  # buckets (1, 2)
        sizes = count_runs(decode, monkeypatch)
        padded = generate(llm)
    finally:
        llm.engine.runner = old
    assert_same(padded, eager)
    assert set(sizes) == {2, 1}  # batches of 5, 4 and 3 were not padded
    assert all(rows == real for rows, real in backend.seen)  # 2 and 1 are exact buckets


def test_mixed_prefill_and_decode_steps_run_eagerly(llm, monkeypatch):
    old = llm.engine.runner
    try:
        decode, _ = install_padded_runner(llm, max_num_seqs=8)
        sizes = count_runs(decode, monkeypatch)
        engine = llm.engine
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        engine.step()  # prefill of 3 tokens: eager
        engine.add_request([8, 9], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        engine.step()  # one decode + one prefill of 2 tokens: eager
        assert sizes == []
        engine.step()  # two decodes
        assert sizes == [2]
        while engine.has_unfinished():
            engine.step()
    finally:
        llm.engine.runner = old


def seq(tokens: list[int], table: tuple[int, ...]) -> ScheduledSeq:
    """A decode of the last token of ``tokens``."""
    req = Request("r", tokens, SamplingParams(max_tokens=4), 4, frozenset())
    return ScheduledSeq(req, len(tokens) - 1, 1, table, samples=True)


def test_buffers_are_rewritten_between_buckets(llm):
    old = llm.engine.runner
    backend = PadSkippingBackend()
    decode = PaddedDecode(old.model, old.kv_caches, BS, MAX_MODEL_LEN, 8, old.device, backend,
                          capture=False)  # fmt: skip
    width = MAX_MODEL_LEN // BS
    three = (seq([1, 2, 3, 4, 5, 6], (10, 11)), seq([7, 8], (20,)), seq([9] * 9, (30, 31, 32)))
    decode.run(three)
    v = decode._views(4)
    assert v.input_ids.tolist() == [6, 8, 9, 0]
    assert v.positions.tolist() == [5, 1, 8, 0]
    assert v.slots.tolist() == [11 * BS + 1, 20 * BS + 1, 32 * BS + 0, PAD_SLOT]
    assert v.seq_lens.tolist() == [6, 2, 9, 0]
    assert v.tables.shape == (4, width)
    assert v.tables[:, :3].tolist() == [[10, 11, 0], [20, 0, 0], [30, 31, 32], [0, 0, 0]]
    assert not v.tables[:, 3:].any()
    one = (seq([4, 4, 4], (40,)),)
    hidden = decode.run(one)
    assert hidden.shape[0] == 1
    v = decode._views(1)
    assert (v.input_ids.tolist(), v.slots.tolist(), v.seq_lens.tolist()) == (
        [4],
        [40 * BS + 2],
        [3],
    )
    assert v.tables[0, :1].tolist() == [40]  # only used columns are written: [0, 1] is stale
    two = (seq([1, 2], (50,)), seq([3, 3, 3, 3, 3], (60, 61)))
    decode.run(two)
    v = decode._views(2)
    assert v.slots.tolist() == [50 * BS + 1, 61 * BS + 0] and v.seq_lens.tolist() == [2, 5]
    assert v.tables[:, :2].tolist() == [[50, 0], [60, 61]]
    assert decode.bucket_for(3) == 4 and decode.bucket_for(8) == 8 and decode.bucket_for(9) is None


def test_failed_capture_falls_back_to_eager(llm, monkeypatch):
    """A capture that raises (here: no CUDA at all) logs, runs that step eagerly through
    the padded buffers, and turns the padded path off for later steps."""
    old = llm.engine.runner
    eager = generate(llm)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    backend = PadSkippingBackend()
    decode = PaddedDecode(old.model, old.kv_caches, BS, MAX_MODEL_LEN, 8, old.device, backend,
                          capture=True)  # fmt: skip
    sizes = count_runs(decode, monkeypatch)
    llm.engine.runner = ModelRunner(
        old.model, old.kv_caches, BS, old.device, old.sampler, backend, decode
    )
    try:
        padded = generate(llm)
    finally:
        llm.engine.runner = old
    assert_same(padded, eager)
    assert decode.disabled and not decode.graphs and sizes == [5]  # then unpadded


def test_upload_sends_only_used_table_columns_at_aligned_offsets(llm, monkeypatch):
    """The packed copy holds the real rows' used block-table columns, not [N, W] (W =
    max_model_len / block_size), and every section the kernels read is 16-byte aligned."""
    old = llm.engine.runner
    decode = PaddedDecode(old.model, old.kv_caches, BS, MAX_MODEL_LEN, 8, old.device,
                          PadSkippingBackend(), capture=False)  # fmt: skip
    sent: list[int] = []
    send = decode.staging.send
    monkeypatch.setattr(
        decode.staging, "send", lambda host, out=None: sent.append(host.size) or send(host, out)
    )
    three = (seq([1, 2, 3, 4, 5, 6], (10, 11)), seq([7, 8], (20,)), seq([9] * 9, (30, 31, 32)))
    decode.run(three)  # bucket 4: ids, pos, slots, lens 4 each, qsl 5 (+1 to align), 3 x 3 table
    assert sent == [4 * 4 + 6 + 10] and decode.width == MAX_MODEL_LEN // BS == 16
    for n in decode.buckets:
        v = decode._views(n)
        for t in (v.input_ids, v.positions, v.slots, v.seq_lens, v.qsl, v.tables):
            assert t.data_ptr() % 16 == 0


class _ReferenceDrafts:
    """Drafts from a reference run, every third one wrong (the rest of it rejected)."""

    name = "oracle"
    costly = False

    def __init__(self, refs: dict[tuple[int, ...], list[int]]) -> None:
        self.refs = refs
        self.calls = 0

    def propose(self, requests, k):
        out = []
        for r in requests:
            self.calls += 1
            done = r.num_output_tokens
            drafts = list(self.refs[tuple(r.prompt_token_ids)][done : done + k])
            if drafts and self.calls % 3 == 0:
                drafts[-1] = (drafts[-1] + 1) % 1000
            out.append(drafts)
        return out

    def finish(self, request) -> None:
        pass


def test_verify_steps_run_as_padded_decode_rows(llm, monkeypatch):
    """Steps verifying draft chains go through the same buffers (and graphs) as decode
    rows, one per token: the output is that of plain decoding."""
    import dataclasses

    from tokenmill.engine.engine import LLMEngine
    from tokenmill.spec_decode import DraftHook

    eager = generate(llm)
    refs = {tuple(p): e.token_ids for p, e in zip(PROMPTS, eager)}
    config = dataclasses.replace(llm.config, check_kv_integrity=True)
    engine = LLMEngine(config, llm.engine.loaded, hooks=[DraftHook(_ReferenceDrafts(refs), 3)])
    old = engine.runner
    backend = PadSkippingBackend()
    decode = PaddedDecode(old.model, old.kv_caches, BS, MAX_MODEL_LEN, 32, old.device, backend,
                          capture=False)  # fmt: skip
    engine.runner = ModelRunner(old.model, old.kv_caches, BS, old.device, old.sampler, backend,
                                decode)  # fmt: skip
    engine.executor.runner = engine.runner
    rows: list[int] = []
    run = decode.run

    def spy(step, tables=None, pending=None, cols=None):
        seqs = step.seqs
        rows.append(sum(s.num_new_tokens for s in seqs) if any(s.draft_token_ids for s in seqs)
                    else 0)  # fmt: skip
        return run(step, tables, pending, cols)

    monkeypatch.setattr(decode, "run", spy)
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS)]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert_same([finals[i] for i in ids], eager)
    assert max(rows) > len(PROMPTS)  # verify steps of several rows per sequence ran padded
    assert any(r and r not in decode.buckets for r in rows)  # and were padded to a bucket
