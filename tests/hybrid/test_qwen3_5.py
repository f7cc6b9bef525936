"""Qwen3.5 (Gated DeltaNet + gated attention) against transformers on random weights.

A 4-layer checkpoint (three linear-attention layers, one full-attention layer) is loaded by
``tokenmill.LLM``. The engine's greedy tokens must be transformers' (its own ``generate``
for one prompt; for a batch, one uncached transformers forward over each prompt + output,
whose argmax after every prefix must be the engine's next token) with log-probs close,
also under preemption (a KV and state pool too small for the batch) and with chunked
prefill (state carried from chunk to chunk).
"""

from __future__ import annotations

import pytest
import torch
from hybrid_checkpoints import (
    assert_matches_hf,
    hf_greedy,
    hybrid_llm,
    make_qwen3_5,
    random_prompts,
    tokenmill_greedy,
)

from tokenmill.errors import InvalidRequestError, UnsupportedModelError
from tokenmill.kv_cache import KVCacheCoordinator
from tokenmill.kv_cache.spec import FullAttention, RecurrentState

STEPS = 32
ATOL = 2e-4  # float32 log-probs: chunked vs per-token scans round differently


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), smollm2_hf_tokenizer)


@pytest.fixture(scope="module")
def hf_model(qwen35_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen35_dir, dtype=torch.float32).eval()


def _llm(path, **options):
    return hybrid_llm(path, **options)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    return random_prompts(n, seed)


def _assert_matches_hf(hf_model, prompts, results) -> None:
    assert_matches_hf(hf_model, prompts, results, STEPS, ATOL)


def test_single_prompt_equals_transformers_generate(qwen35_dir):
    prompt = [5, 17, 99, 3, 250, 8, 41, 1000, 12]
    llm = _llm(qwen35_dir)
    kv = llm.engine.kv
    assert isinstance(kv, KVCacheCoordinator)
    assert [g.layers for g in kv.groups] == [(3,), (0, 1, 2)]  # paged attention, state slots
    (tokens, logprobs), = tokenmill_greedy(llm, [prompt], STEPS)  # fmt: skip
    (hf_tokens, hf_logprobs), = hf_greedy(qwen35_dir, [prompt], STEPS)  # fmt: skip
    assert tokens == hf_tokens
    torch.testing.assert_close(logprobs, hf_logprobs, atol=ATOL, rtol=0)
    assert kv.slots.num_free == kv.slots.num_slots and kv.num_free_blocks == kv.num_blocks


def test_batch_of_12_under_preemption(qwen35_dir, hf_model):
    """56 blocks of 4 tokens and 4 state slots for 12 sequences of up to 72 tokens:
    requests wait for slots, are preempted (blocks and slot freed) and recomputed."""
    prompts = _prompts(12)
    llm = _llm(qwen35_dir, num_kv_blocks=56, ssm_state_cache_size=4)
    results = tokenmill_greedy(llm, prompts, STEPS)
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv
    assert kv.slots.num_slots == 4 and kv.slots.num_free == 4 and kv.num_free_blocks == 56
    _assert_matches_hf(hf_model, prompts, results)


def test_chunked_prefill_equals_one_chunk(qwen35_dir, hf_model):
    """A 16-token budget splits every prompt over steps that also run other sequences'
    decodes; the recurrent state carries across chunks."""
    prompts = [_prompts(1, seed=7)[0] * 3, *_prompts(3, seed=8)]  # one of up to 120 tokens
    prompts[0] = prompts[0][:90]
    one = tokenmill_greedy(_llm(qwen35_dir, max_model_len=160), prompts, STEPS)
    chunked = tokenmill_greedy(
        _llm(qwen35_dir, max_model_len=160, max_num_batched_tokens=16, max_num_seqs=4),
        prompts, STEPS,
    )  # fmt: skip
    for (a, la), (b, lb) in zip(one, chunked):
        assert a == b
        torch.testing.assert_close(la, lb, atol=ATOL, rtol=0)
    _assert_matches_hf(hf_model, prompts[:1], one[:1])


def test_cache_specs_follow_layer_types(qwen35_dir):
    llm = _llm(qwen35_dir)
    specs = llm.engine.kv.groups
    model = llm.engine.runner.model
    kinds = [type(s) for s in model.cache_specs()]
    assert kinds == [RecurrentState] * 3 + [FullAttention]
    state = model.cache_specs()[0]
    # conv window [2 * 2 * 16 + 4 * 16, K - 1 = 3] + delta state [4 heads, 16, 16], float32
    assert state.parts == ((128, 3), (4, 16, 16)) and state.slot_bytes() == (384 + 1024) * 4
    assert len(specs) == 2


# -- bad input -------------------------------------------------------------------------------


def test_unknown_layer_type_is_refused(qwen35_dir):
    """The model's own check of ``layer_types``, directly (an unknown kind, a wrong count)."""
    import json

    from tokenmill.models.qwen3_5 import Qwen3_5ForCausalLM

    config = json.loads((qwen35_dir / "config.json").read_text())
    config["layer_types"][1] = "mamba"
    with torch.device("meta"), pytest.raises(UnsupportedModelError, match="unknown .'mamba'."):
        Qwen3_5ForCausalLM(config, torch.float32)
    config["layer_types"] = ["linear_attention"] * 2 + ["full_attention"]
    with torch.device("meta"), pytest.raises(UnsupportedModelError, match="3 entries"):
        Qwen3_5ForCausalLM(config, torch.float32)


def test_unknown_layer_type_in_config_json_is_refused_at_load(qwen35_dir, tmp_path):
    """The loader keeps config.json's ``layer_types`` as written (transformers' config class
    would put its default pattern in its place): LLM refuses the bad entry by name."""
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(qwen35_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["layer_types"][1] = "mamba"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="unknown .'mamba'."):
        _llm(bad)


def test_state_pool_options(qwen35_dir):
    with pytest.raises(InvalidRequestError, match="both size the state pool"):
        _llm(qwen35_dir, ssm_state_cache_size=4, ssm_full_memory_ratio=0.5)
    with pytest.raises(InvalidRequestError, match="ssm_state_cache_size must be a positive"):
        _llm(qwen35_dir, ssm_state_cache_size=0)
    with pytest.raises(InvalidRequestError, match="ssm_full_memory_ratio must be > 0"):
        _llm(qwen35_dir, ssm_full_memory_ratio=0.0)
    # 64 blocks x 4 tokens x 1 layer x 2 x 2 heads x 16 x 4 bytes = 64 KiB of KV; a slot
    # takes 3 x 5632 bytes: 1e-3 of the KV holds none
    with pytest.raises(InvalidRequestError, match="state pool holds no request"):
        _llm(qwen35_dir, ssm_full_memory_ratio=1e-3)
    llm = _llm(qwen35_dir, ssm_full_memory_ratio=0.5, max_num_seqs=8)
    assert llm.engine.kv.slots.num_slots == min(8, (65536 // 2) // (3 * 5632))


def test_language_model_of_the_vision_checkpoint(tmp_path, smollm2_hf_tokenizer):
    """Qwen3_5ForConditionalGeneration: its ``model.language_model`` weights, text input."""
    from hybrid_checkpoints import make_qwen3_5_vl
    from transformers import AutoModelForImageTextToText

    path = make_qwen3_5_vl(tmp_path / "vl", smollm2_hf_tokenizer)
    prompts = _prompts(2, seed=3)
    results = tokenmill_greedy(_llm(path), prompts, STEPS)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    _assert_matches_hf(hf, prompts, results)


def test_state_pool_flags():
    """``tokenmill serve`` flags reach EngineConfig under the LLM keyword names."""
    import argparse

    from tokenmill.entrypoints.args import add_engine_flags, engine_options

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--model", "m", "--ssm-state-cache-size", "8"])
    options = engine_options(args)
    assert options["ssm_state_cache_size"] == 8 and options["ssm_full_memory_ratio"] is None
    args = parser.parse_args(["--model", "m", "--ssm-full-memory-ratio", "0.25"])
    assert engine_options(args)["ssm_full_memory_ratio"] == 0.25


def test_native_float32_kernel_when_asked(qwen35_dir, hf_model, monkeypatch):
    """With ``TOKENMILL_FP32_GEMM=native`` the hybrid's dense float32 linears and tables move
    into the native float32 kernel's tiles after loading (no dense weight is left), and the
    batch still follows transformers: each step's greedy pick given the same prefix, and the
    log-probs to the float32 tolerance."""
    from tokenmill import native
    from tokenmill.layers.linear import Linear, VocabEmbedding

    if native.active_isa() is None:
        pytest.skip("no native kernels here")
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", "native")
    llm = _llm(qwen35_dir)
    model = llm.engine.loaded.model
    layers = [m for m in model.modules() if isinstance(m, Linear | VocabEmbedding)]
    assert layers and all(m.method.name == "fp32" and not hasattr(m, "weight") for m in layers)
    prompts = _prompts(4, seed=3)
    _assert_matches_hf(hf_model, prompts, tokenmill_greedy(llm, prompts, STEPS))


def test_bundle_keeps_the_native_float32_layers(qwen35_dir, tmp_path, monkeypatch):
    """The hybrid's dense float32 layers move into the native kernel's tiles after the
    load; the bundle written then maps into the same tiles at the next start (warm, no
    rebuild) and gives the same tokens."""
    from tokenmill import native
    from tokenmill.layers.linear import Linear

    if native.active_isa() is None:
        pytest.skip("no native kernels here")
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", "native")
    prompts = _prompts(2, seed=5)
    runs = []
    for _ in range(2):
        llm = _llm(qwen35_dir, prepare_bundle=True, cache_dir=str(tmp_path))
        loaded = llm.engine.loaded
        moved = all(
            m.method.name == "fp32" for m in loaded.model.modules() if isinstance(m, Linear)
        )
        runs.append(("bundle write" in loaded.phases, moved, tokenmill_greedy(llm, prompts, 6)))
        llm.close()
    (wrote, cold_moved, cold), (rewrote, warm_moved, warm) = runs
    assert (wrote, rewrote) == (True, False)
    assert cold_moved and warm_moved
    for (tokens, logprobs), (want, want_logprobs) in zip(warm, cold, strict=True):
        assert tokens == want and torch.equal(logprobs, want_logprobs)
