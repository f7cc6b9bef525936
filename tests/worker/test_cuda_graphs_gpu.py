"""CUDA graphs and pinned transfers on a GPU (marked ``gpu``; skipped without CUDA).

The model folder is made here (a tiny random Llama and a word-level tokenizer), so the
tests need no downloaded tokenizer on the GPU machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_padded_decode import generate
from test_step_inputs import upload

from tokenmill import LLM, SamplingParams
from tokenmill.worker.cuda_graphs import PaddedDecode
from tokenmill.worker.inputs import HostIds, PinnedStaging
from tokenmill.worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB, MAX_MODEL_LEN, BS = 256, 128, 16


def write_tiny_llama(folder: Path) -> Path:
    """2-layer Llama with weights scaled up (clear-cut greedy choices), word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                   eos_token="t2")  # fmt: skip
    fast.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == VOCAB
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-gpu"))


def make_llm(model_dir: Path, **overrides) -> LLM:
    pytest.importorskip("triton")
    opts = dict(device="cuda", dtype="float32", attention_backend="triton",
                max_model_len=MAX_MODEL_LEN, num_kv_blocks=128, block_size=BS,
                enable_prefix_caching=False, max_num_seqs=8)  # fmt: skip
    return LLM(str(model_dir), **(opts | overrides))


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs):
            tok = next(iter(lw))  # the sampled token
            assert lg[tok].logprob == pytest.approx(lw[tok].logprob, abs=1e-3)


def test_pinned_staging_and_host_ids():
    cuda = torch.device("cuda")
    staging = PinnedStaging(cuda)
    first = upload(staging, list(range(10)))
    second = upload(staging, [7] * 5000)  # grows the pinned buffer
    assert first.device.type == "cuda" and first.tolist() == list(range(10))
    assert second.tolist() == [7] * 5000
    out = torch.zeros(3, dtype=torch.int64, device=cuda)
    upload(staging, [4, 5, 6], out=out)
    assert out.tolist() == [4, 5, 6]
    ids = torch.tensor([9, 8, 7], device=cuda)
    host_ids = HostIds(cuda)
    host = host_ids.copy(ids)
    torch.cuda.synchronize()
    assert host.is_pinned() and host.tolist() == [9, 8, 7]


def test_graph_replay_matches_eager(model_dir):
    llm = make_llm(model_dir, enforce_eager=True)
    try:
        assert llm.engine.runner.decode is None
        eager = generate(llm)
        old = llm.engine.runner
        decode = PaddedDecode(old.model, old.kv_caches, BS, MAX_MODEL_LEN, 8, old.device,
                              old.backend, capture=True)  # fmt: skip
        llm.engine.runner = ModelRunner(
            old.model, old.kv_caches, BS, old.device, old.sampler, old.backend, decode
        )
        graphed = generate(llm)  # decode batches 5, 4, 3, 2, 1: buckets 8, 4, 4, 2, 1
        again = generate(llm)  # replays only
    finally:
        llm.close()
    assert not decode.disabled
    assert set(decode.graphs) == {8, 4, 2, 1}
    assert_same(graphed, eager)
    assert_same(again, eager)


def test_engine_captures_graphs_for_a_capturable_backend(model_dir):
    llm = make_llm(model_dir)
    try:
        runner = llm.engine.runner
        if not getattr(runner.backend, "supports_cuda_graphs", False):
            pytest.skip(f"backend {runner.backend.name} does not declare supports_cuda_graphs")
        assert runner.decode is not None and set(runner.decode.graphs) == {1, 2, 4, 8}
        graphed = generate(llm)
    finally:
        llm.close()
    eager_llm = make_llm(model_dir, enforce_eager=True)
    try:
        assert eager_llm.engine.runner.decode is None
        assert_same(graphed, generate(eager_llm))
    finally:
        eager_llm.close()


def test_async_scheduling_matches_sync_on_cuda(model_dir):
    """auto = on for CUDA: with graphs, greedy + logprobs and seeded sampling give what
    synchronous steps give, and the runner did take input tokens from the device."""
    prompts = [{"prompt_token_ids": [5 + i, 9, 14 + i, 3]} for i in range(6)]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=6 + i, ignore_eos=True)
              for i in range(6)]  # fmt: skip
    sync_llm = make_llm(model_dir, async_scheduling="off")
    try:
        assert not sync_llm.engine.overlap
        want = generate(sync_llm), sync_llm.generate(prompts, seeded)
    finally:
        sync_llm.close()
    llm = make_llm(model_dir)
    try:
        assert llm.engine.overlap
        runner, taken = llm.engine.runner, []
        real = runner._pending_tokens
        runner._pending_tokens = lambda seqs: taken.append(real(seqs)) or taken[-1]
        got = generate(llm), llm.generate(prompts, seeded)
    finally:
        llm.close()
    assert_same(got[0], want[0])
    assert [o.outputs[0].token_ids for o in got[1]] == [o.outputs[0].token_ids for o in want[1]]
    assert any(p is not None for p in taken)


def test_bf16_model_is_built_on_the_device(model_dir):
    llm = make_llm(model_dir, dtype="auto", enforce_eager=True)
    try:
        params = list(llm.engine.loaded.model.parameters())
        assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)
        out = llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True)
        )
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_prompt_logprobs_of_chunks_that_sample_nothing(model_dir):
    """A prompt prefilled in chunks: the chunks before the last sample nothing, yet their
    prompt logprobs come back through non-blocking copies. They equal one-chunk prefill's."""
    prompt = {"prompt_token_ids": [(7 * j) % 200 + 10 for j in range(40)]}
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    outs = {}
    for threshold in (None, 8):
        llm = make_llm(model_dir, long_prefill_token_threshold=threshold)
        try:
            outs[threshold] = llm.generate(prompt, params)[0].prompt_logprobs
        finally:
            llm.close()
    whole, chunked = outs[None], outs[8]
    assert len(whole) == len(chunked) == 40 and whole[0] is None and chunked[0] is None
    for w, c in zip(whole[1:], chunked[1:]):
        assert w.keys() == c.keys()
        for tok in w:
            assert c[tok].logprob == pytest.approx(w[tok].logprob, abs=1e-4)
