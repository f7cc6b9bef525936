"""A Hugging Face SmolLM2 folder in bfloat16 / float16 (made from the embedded GGUF) on the
default CPU path against transformers on the same weights upcast to float32: greedy
tokens and held-out logprobs. Also the quantization="int8"/"int4" of the same folder,
within the bounds docs/architecture.md gives (measured here)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from test_quality import HELD_OUT, N_TOKENS, PROMPTS, common_prefix

from tokenmill import LLM, SamplingParams, native
from tokenmill.models.native_decode import NativeDecode

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable here")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _cache() -> Path:  # the same place as tests/conftest.py's model files
    return Path(os.environ.get("TOKENMILL_TEST_CACHE", Path.home() / ".cache" / "tokenmill-tests"))


def make_hf_folder(gguf: Path, dtype: torch.dtype, target: Path) -> Path:
    """transformers dequantizes the GGUF; the weights are saved as an HF folder in dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (target / "model.safetensors").is_file():
        return target
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(partial)
    partial.replace(target)
    return target


@pytest.fixture(scope="module", params=list(DTYPES))
def hf_folder(request, smollm2_gguf) -> tuple[str, Path]:
    name = request.param
    return name, make_hf_folder(smollm2_gguf, DTYPES[name], _cache() / f"smollm2-135m-{name}")


@pytest.fixture(scope="module")
def reference(hf_folder, smollm2_hf_tokenizer) -> tuple[list[list[int]], list[float]]:
    """transformers with the 16-bit weights upcast to float32: (greedy tokens per prompt,
    held-out logprobs), computed once per folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_folder[1]), dtype=torch.float32).eval()
    tok = smollm2_hf_tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    return hf_greedy(model, prompts), hf_logprobs(
        model, tok.encode(HELD_OUT, add_special_tokens=False)
    )


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """Plain argmax steps with the KV cache: EOS is neither masked (as generate's
    min_new_tokens would) nor stopping, as tokenmill's ignore_eos."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = model(torch.tensor([p]), use_cache=True)
            tokens = []
            for _ in range(N_TOKENS):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values,
                            use_cache=True)  # fmt: skip
            outs.append(tokens)
    return outs


def hf_logprobs(model, ids: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return [logits[i - 1, t].item() for i, t in enumerate(ids) if i > 0]


def tm_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def tm_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    return [d[t].logprob for d, t in zip(out.prompt_logprobs, ids) if d]


def compare(llm: LLM, reference) -> tuple[list[int], float, float]:
    """(greedy tokens equal per prompt, max and mean |logprob delta| on the held-out text)."""
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    matched = [common_prefix(a, b) for a, b in zip(tm_greedy(llm, prompts), reference[0])]
    ids = llm.tokenizer.encode(HELD_OUT)
    ours, theirs = torch.tensor(tm_logprobs(llm, ids)), torch.tensor(reference[1])
    delta = (ours - theirs).abs()
    return matched, delta.max().item(), (ours - theirs).mean().item()


def test_16bit_folder_keeps_its_weights_and_matches_transformers(hf_folder, reference) -> None:
    name, folder = hf_folder
    with LLM(str(folder), max_model_len=512) as llm:
        loaded = llm.engine.loaded
        assert loaded.quantization == name and loaded.dtype == torch.float32
        head = loaded.model.model.embed_tokens.method
        assert head.name == name and head.dtype == DTYPES[name]
        assert NativeDecode.build(loaded.model) is not None  # the one-call decode layers
        matched, max_delta, mean_delta = compare(llm, reference)
    print(f"{name}: greedy tokens equal {matched}; held-out logprob |delta| max {max_delta:.2e}, "
          f"mean delta {mean_delta:+.2e}")  # fmt: skip
    assert all(m == N_TOKENS for m in matched), matched
    # Measured: max 7.5e-3, mean -4e-5 for both formats and for the exact-product FMA
    # kernel alike (the fast float32 path's norm/attention rounding, not the 16-bit kernels).
    assert max_delta < 0.03 and abs(mean_delta) < 2e-4


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_at_load(hf_folder, reference, quantization: str) -> None:
    name, folder = hf_folder
    if name != "bf16":
        pytest.skip("one 16-bit folder is enough for the quantized formats")
    with LLM(str(folder), quantization=quantization, max_model_len=512) as llm:
        assert llm.engine.loaded.quantization == quantization
        matched, max_delta, mean_delta = compare(llm, reference)
    print(f"{quantization}: greedy tokens equal {matched}; held-out logprob |delta| max "
          f"{max_delta:.2e}, mean delta {mean_delta:+.2e}")  # fmt: skip
    bound = {"int8": (16, 0.02), "int4": (4, 0.3)}[quantization]  # (tokens, mean delta)
    assert sum(m >= bound[0] for m in matched) >= 0.75 * len(PROMPTS), matched
    assert abs(mean_delta) < bound[1]
