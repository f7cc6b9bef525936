"""Warm (mapped bundle) and cold loads compute the same logits, bit for bit, and the same
greedy tokens: SmolLM2 Q4_1 (the default model), an HF safetensors folder, a float32
dequantized GGUF load."""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner

from tokenmill import LLM, SamplingParams
from tokenmill.bundles.tensor_file import ALIGN
from tokenmill.config import EngineConfig
from tokenmill.engine.loading import load_model
from tokenmill.tokenizer import hf_folder

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _logits(loaded, prompt_ids: list[int], steps: int = 4) -> list[torch.Tensor]:
    """Prefill then ``steps`` greedy decodes over a paged cache: the logits of each step."""
    runner = PagedRunner(loaded.model, backend=loaded.model.ops.backend)
    out = [runner.step([("s", prompt_ids)])[0][-1]]
    for _ in range(steps):
        out.append(runner.step([("s", [int(out[-1].argmax())])])[0][-1])
    return out


def _check(model: str | None, tmp_path, **options) -> None:
    config = EngineConfig(model=model, prepare_bundle=True, cache_dir=str(tmp_path), **options)
    cold = load_model(config)  # builds and writes the bundle
    warm = load_model(config)  # maps it
    assert warm.model is not cold.model
    assert {"resolve", "tokenizer", "weights", "bundle write"} <= set(cold.phases)
    assert {"resolve", "tokenizer", "weights"} <= set(warm.phases)
    assert "bundle write" not in warm.phases
    assert (warm.dtype, warm.quantization, warm.max_model_len) == (
        cold.dtype, cold.quantization, cold.max_model_len
    )  # fmt: skip
    cold_state = dict(cold.model.named_buffers()) | dict(cold.model.named_parameters())
    for name, t in (dict(warm.model.named_buffers()) | dict(warm.model.named_parameters())).items():
        assert torch.equal(t, cold_state[name]), name
        assert t.data_ptr() % ALIGN == 0, name
    tok = cold.tokenizer
    assert warm.tokenizer.eos_token_ids == tok.eos_token_ids
    assert warm.tokenizer.chat_template == tok.chat_template
    assert hf_folder.generic_class(next(tmp_path.glob("*/tokenizer")))  # the fast form
    assert hf_folder.differences(tok.hf, warm.tokenizer.hf) == []
    for prompt in PROMPTS:
        ids = tok.hf.encode(prompt)
        assert warm.tokenizer.hf.encode(prompt) == ids
        for a, b in zip(_logits(cold, ids), _logits(warm, ids), strict=True):
            assert torch.equal(a, b)  # bit for bit
    _check_mapped(warm, tmp_path)
    del cold, warm
    _check_greedy(config)


def _check_mapped(warm, folder) -> None:
    """The warm weights are views of the one mapped file, not copies."""
    weights = str(next(folder.glob("*/weights.safetensors")))
    spans = [line.split()[0].split("-") for line in open("/proc/self/maps") if weights in line]
    assert spans
    for t in warm.model.state_dict().values():
        assert any(int(a, 16) <= t.data_ptr() < int(b, 16) for a, b in spans)


def _check_greedy(config: EngineConfig) -> None:
    """The engine's own path (the native whole-layer decode where it applies) from a cold
    load without bundles and from the bundle: same tokens, same logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    runs = []
    for prepare in (False, True):
        llm = LLM(config.model, prepare_bundle=prepare, cache_dir=config.cache_dir,
                  dtype=config.dtype, max_model_len=config.max_model_len, num_kv_blocks=64,
                  block_size=16)  # fmt: skip
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, _logprobs(o.outputs[0])) for o in outs])
        llm.close()
    assert runs[0] == runs[1]


def _logprobs(completion) -> list[dict[int, float]]:
    return [{k: v.logprob for k, v in step.items()} for step in completion.logprobs]


def test_default_model_q4_1(tmp_path):
    _check(None, tmp_path, max_model_len=512)


def test_hf_folder(tiny_llama_dir, tmp_path):
    _check(str(tiny_llama_dir), tmp_path, dtype="float32", max_model_len=256)


def test_float32_dequantized_gguf(smollm2_gguf, tmp_path):
    _check(str(smollm2_gguf), tmp_path, dtype="float32", max_model_len=256)


@pytest.mark.slow
def test_gemma3_q4_k_m(gemma3_gguf, tmp_path):
    """Sandwich norms, a scaled embedding, two rotary tables: no whole-layer native decode."""
    _check(str(gemma3_gguf), tmp_path, max_model_len=256)
