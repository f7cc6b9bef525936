"""activation_precision="low": the CPU int4/int8 kernels quantize each group of 32
activations into one int8 term instead of two (llama.cpp's precision, half the
multiply-adds). Every path of a model takes it (prefill, the native decode layers, the
output head, a prepared bundle); it really changes the numbers; the engine's guarantees
hold inside it (a batch equals its requests alone, speculation leaves greedy output as it
is); its quality cost against the dequantized float32 reference stays within the bounds
docs/architecture.md gives; and it is refused where it would change nothing."""

from __future__ import annotations

import argparse

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_synth import synthetic_tensors, write_gguf
from test_quality import HELD_OUT, PROMPTS, common_prefix, greedy, held_out_logprobs
from test_quantized_load import decode_logits

from tokenmill import LLM, SamplingParams, native
from tokenmill.config import EngineConfig
from tokenmill.loader import load_checkpoint
from tokenmill.models import resolve_model_class
from tokenmill.models.native_decode import NativeDecode
from tokenmill.quant.plan import build_plan

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")


def build(path, precision: str):
    ckpt = load_checkpoint(str(path))
    plan = build_plan("gguf", ckpt.source.tensor_types(), precision)
    cls = resolve_model_class(ckpt.hf_config["architectures"])
    model = cls(ckpt.hf_config, torch.float32, max_positions=128, quant=plan)
    model.load_weights(ckpt.weights(torch.float32, keep_quantized=True))
    return model.eval()


def affine_terms(model: torch.nn.Module) -> set[int]:
    """The activation terms of every module holding affine-group tiles."""
    return {m.method.activation_terms for m in model.modules() if hasattr(m, "qtiles")}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("low")
    return write_gguf(folder / "m.gguf", synthetic_tensors([Q.Q4_1, Q.Q4_K, Q.Q8_0]))


def test_every_affine_layer_and_the_head_take_one_term(synthetic, native_level) -> None:
    assert affine_terms(build(synthetic, "low")) == {1}
    assert affine_terms(build(synthetic, "high")) == {2}


def test_native_decode_layers_equal_the_per_op_path(synthetic, native_level) -> None:
    """The whole-layer decode call (decoder_layer.c's Proj.terms) computes what the per-op
    path (AffineGroupMethod.apply) does with one term, and one term is not two."""
    prompts = [[1, 5, 9, 33, 2], [7, 7, 8, 12, 40, 41, 3, 5, 1, 2, 60, 61, 19]]
    low = build(synthetic, "low")
    fast = NativeDecode.build(low)
    assert fast is not None
    fused = decode_logits(low, prompts, steps=6, fast=fast)
    per_op = decode_logits(low, prompts, steps=6)
    for a, b in zip(fused, per_op):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    high = decode_logits(build(synthetic, "high"), prompts, steps=1)[0]
    assert (high - fused[0]).abs().max() > 1e-3 * high.abs().max()


@pytest.fixture(scope="module")
def engines():
    low = LLM(max_model_len=512, activation_precision="low")
    reference = LLM(dtype="float32", quantization="none", max_model_len=512)
    yield low, reference
    low.close()
    reference.close()


def test_quality_within_the_documented_bounds(engines) -> None:
    """Measured on SmolLM2-135M Q4_1 (2026-12-07): greedy prefixes equal to the reference
    for 9-32 of 32 tokens (two terms: all 32), held-out logprobs 0.063 apart on average per
    token (two terms: 0.0009), mean logprob 0.009 apart. A wrong one-term scheme (a lost
    offset term, a wrong group scale) is far outside these bounds."""
    low, reference = engines
    assert low.engine.loaded.quantization == "gguf"
    prompts = [low.tokenizer.encode(p) for p in PROMPTS]
    matched = [
        common_prefix(a, b) for a, b in zip(greedy(low, prompts), greedy(reference, prompts))
    ]
    print("greedy tokens matching the reference, per prompt:", matched)
    assert sum(m >= 8 for m in matched) >= 0.75 * len(prompts), matched
    q, r = held_out_logprobs(low), held_out_logprobs(reference)
    assert len(q) == len(r) > 50
    per_token = sum(abs(a - b) for a, b in zip(q, r)) / len(q)
    mean_diff = abs(sum(q) / len(q) - sum(r) / len(r))
    print(f"per-token |logprob delta| {per_token:.4f}, mean logprob delta {mean_diff:.4f}")
    assert per_token < 0.15 and mean_diff < 0.05, (per_token, mean_diff)


def test_a_batch_equals_its_requests_alone(engines) -> None:
    low = engines[0]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    prompts = PROMPTS[:4]
    batched = low.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        alone = low.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == out.outputs[0].token_ids
        assert [{k: v.logprob for k, v in s.items()} for s in alone.logprobs] == [
            {k: v.logprob for k, v in s.items()} for s in out.outputs[0].logprobs
        ]


def test_prefix_cache_hits_are_reused_and_deterministic(engines) -> None:
    """Warm requests reuse the cold one's KV blocks and agree with each other bit for bit.
    (Against the cold request they agree only to the mode's own noise: the warm one
    computes its last token on the decode path, the cold one in the prefill, and one int8
    term turns that float32 difference into a rounding flip here and there: 0.19 on the
    first token's logprob of the held-out text, where two terms move it by 4e-4; see
    docs/architecture.md.)"""
    low = engines[0]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    before = low.engine.kv.num_free_blocks
    text = " ".join(reversed(HELD_OUT.split()))  # no earlier test cached it
    cold, warm, again = (low.generate(text, params, use_tqdm=False)[0] for _ in range(3))
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens > 64
    assert warm.outputs[0].token_ids == again.outputs[0].token_ids
    lps = [
        [{k: v.logprob for k, v in s.items()} for s in o.outputs[0].logprobs] for o in (warm, again)
    ]
    assert lps[0] == lps[1]
    assert low.engine.kv.num_free_blocks == before


def test_speculation_keeps_greedy_output(engines) -> None:
    """Verify steps of several tokens run the 8-token blocks; decode steps one token: the
    same bits per token, so prompt lookup changes nothing in the output."""
    low = engines[0]
    spec = LLM(
        max_model_len=512, activation_precision="low",
        speculative_config={"method": "ngram", "num_speculative_tokens": 8},
    )  # fmt: skip
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog, twice over. " * 2
    ids = low.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    params = SamplingParams(temperature=0, max_tokens=40)
    want = low.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    got = spec.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    stats = spec.get_scheduling_metrics()
    spec.close()
    assert got.token_ids == want.token_ids
    assert stats["spec_decode_num_accepted_tokens"] > 0  # verify steps did run


def test_a_bundle_keeps_the_choice(tmp_path) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    runs = []
    for _ in range(2):  # cold (writes the bundle), then warm (maps it)
        llm = LLM(max_model_len=256, activation_precision="low", prepare_bundle=True,
                  cache_dir=str(tmp_path))  # fmt: skip
        assert affine_terms(llm.engine.loaded.model) == {1}
        out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        runs.append((out.token_ids, [{k: v.logprob for k, v in s.items()} for s in out.logprobs]))
        llm.close()
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "options, words",
    [
        ({"activation_precision": "medium"}, ["activation_precision='medium'", "high, low"]),
        (
            {"activation_precision": "low", "dtype": "float32", "quantization": "none"},
            ["activation_precision='low'", "quantization='none'"],
        ),
    ],
)
def test_refused_where_it_would_change_nothing(options, words) -> None:
    with pytest.raises(ValueError) as info:
        LLM(max_model_len=256, **options)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_the_config_field_and_its_flag() -> None:
    assert EngineConfig().activation_precision == "high"
    from tokenmill.entrypoints.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--activation-precision", "low"]).activation_precision == "low"
