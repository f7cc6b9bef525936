"""Tensor and pipeline parallelism together: TP=2 x PP=2 over 4 gloo ranks gives the
one-process tokens; each rank holds its shard of its stage; bad sizes and a dead rank are
clear errors."""

from __future__ import annotations

import os
import signal
import time

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_synth import synthetic_tensors, write_gguf
from scale_out_models import save_family

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.distributed.config import check_devices
from tokenmill.distributed.grid import Grid
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.inputs import TokensPrompt

PROMPTS = [
    TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9, 10]),
    TokensPrompt(prompt_token_ids=[(11 * j) % 400 + 20 for j in range(130)]),
    TokensPrompt(prompt_token_ids=[300, 7, 300, 7, 42]),
]  # 141 rows in the first step: cut into 2 micro-batches, the cut inside the long prompt
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
SCORED = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
TP_PP = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}


def test_grid_places_the_driver_on_the_last_stage():
    grid = Grid(tp=2, pp=2)
    # ranks 0, 1: the last stage (rank 0 drives); ranks 2, 3: stage 0
    assert [(grid.stage_of(r), grid.tp_rank_of(r)) for r in range(4)] == [
        (1, 0), (1, 1), (0, 0), (0, 1)
    ]  # fmt: skip
    assert grid.peer(3, 1) == 1 and grid.peer(0, 0) == 2  # activations go TP rank to TP rank
    assert grid.stage_ranks() == [[0, 1], [2, 3]]
    assert [Grid(1, 3).stage_of(r) for r in range(3)] == [2, 0, 1]  # plain PP as before
    assert [Grid(3, 1).tp_rank_of(r) for r in range(3)] == [0, 1, 2]  # plain TP as before


def _outputs(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _close(a, b, tol):
    return a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < tol for t in a)


@pytest.mark.parametrize("family", ["llama_bias_padded_vocab", "qwen3_one_kv_head"])
def test_tp2_pp2_greedy_equals_one_process(family, tmp_path, smollm2_hf_tokenizer):
    """Untied (stage 0's table and the last stage's head split, biases on rank 0) and tied
    with one KV head for two ranks (replicated; the last stage scores with its table)."""
    path = save_family(family, tmp_path / family, smollm2_hf_tokenizer)
    options = dict(dtype="float32", num_kv_blocks=64)
    with LLM(str(path), **options) as llm:
        ref = _outputs(llm, PROMPTS, GREEDY)
        ref_scored = llm.generate(PROMPTS[:1], SCORED, use_tqdm=False)[0]
    with LLM(str(path), **options, **TP_PP) as llm:
        executor = llm.engine.executor
        assert isinstance(executor, MultiprocExecutor) and len(executor.ranks.workers.procs) == 3
        local = llm.engine.loaded.model.local  # the driver: TP rank 0 of the last stage
        assert len(local.model.layers) == 1  # layer 1 of 2, renumbered 0
        attn = local.model.layers[0].self_attn
        kv_rows = 2 * 16 if family.startswith("llama") else 2 * 32  # 1 of 2 KV heads / replicated
        assert attn.qkv_proj.out_features == 2 * local.head_dim + kv_rows  # 2 of 4 heads
        batched = _outputs(llm, PROMPTS, GREEDY)
        single = [_outputs(llm, [p], GREEDY)[0] for p in PROMPTS]
        scored = llm.generate(PROMPTS[:1], SCORED, use_tqdm=False)[0]
    for outs in (batched, single):
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        for a, b in zip(outs, ref):  # the same distribution, up to the order of float sums
            assert all(_close(pa, pb, 1e-3) for pa, pb in zip(a.logprobs, b.logprobs, strict=True))
    pairs = zip(scored.prompt_logprobs[1:], ref_scored.prompt_logprobs[1:], strict=True)
    assert all(_close(a, b, 1e-3) for a, b in pairs)


def test_quantized_gguf_tp2_pp2_equals_one_process(tmp_path, smollm2_hf_tokenizer):
    tok = tmp_path / "tok"
    smollm2_hf_tokenizer.save_pretrained(tok)
    path = write_gguf(tmp_path / "m.gguf", synthetic_tensors([Q.Q4_0, Q.Q8_0]))
    prompts = [
        TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9]),
        TokensPrompt(prompt_token_ids=[40, 3]),
    ]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(**options):
        with LLM(str(path), tokenizer=str(tok), num_kv_blocks=32, **options) as llm:
            return [o.token_ids for o in _outputs(llm, prompts, greedy)]

    assert tokens(**TP_PP) == tokens()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return save_family("llama_tied", tmp_path_factory.mktemp("tp_pp") / "m", smollm2_hf_tokenizer)


@pytest.mark.parametrize(
    "sizes, match",
    [
        ((3, 2), "tensor_parallel_size=3 can not split.*heads=4"),
        ((2, 3), "pipeline_parallel_size=3 is more than the model's 2 layers"),
    ],
)
def test_bad_sizes_are_refused_before_any_worker(llama_dir, sizes, match):
    started = time.monotonic()
    with pytest.raises(ValueError, match=match):
        LLM(str(llama_dir), tensor_parallel_size=sizes[0], pipeline_parallel_size=sizes[1])
    assert time.monotonic() - started < 5  # no process was spawned, no weight read


def test_ranks_are_the_product_of_the_sizes():
    parallel = EngineConfig(**TP_PP).parallel  # accepted now (was refused)
    assert parallel.world_size == 4
    check_devices(parallel, 4)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 is 4 ranks.*but 2 are visible"):
        check_devices(parallel, 2)


def test_a_dead_rank_of_an_earlier_stage_fails_requests_cleanly(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32, **TP_PP)
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    sp = SamplingParams(temperature=0, max_tokens=4)
    prompt = TokensPrompt(prompt_token_ids=[5, 6, 7, 8])
    assert llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    os.kill(executor.ranks.workers.procs[2].pid, signal.SIGKILL)  # rank 3: stage 0, TP rank 1
    started = time.monotonic()
    [out] = llm.generate([prompt], sp, use_tqdm=False)
    assert out.outputs[0].finish_reason == "error"
    assert "worker rank" in out.error and "restart it" in out.error
    [again] = llm.generate([prompt], sp, use_tqdm=False)  # later requests fail at once
    assert again.outputs[0].finish_reason == "error" and "worker rank" in again.error
    assert time.monotonic() - started < 30
    llm.close()
