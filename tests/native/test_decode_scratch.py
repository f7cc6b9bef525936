"""The whole-layer CPU decode keeps its scratch buffers across steps (models/native_decode.py):
after they grow for a larger batch and longer contexts, and when a step needs less than they
hold, every request's tokens and logprobs are those of a fresh engine; a large buffer is given
back once the steps need a small part of it."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams, host_memory, native

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")

PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)


def _prompts(n: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [100 + 7 * i + j for j in range(length)]} for i in range(n)]


def _result(outs) -> list:
    return [
        (o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs
    ]


def _run(llm: LLM, prompts: list[dict]) -> list:
    return _result(llm.generate(prompts, PARAMS, use_tqdm=False))


def test_kept_scratch_gives_a_fresh_engines_results(smollm2_gguf):
    short, wide = _prompts(1, 9), _prompts(5, 300)
    with LLM(str(smollm2_gguf), enable_prefix_caching=False) as llm:
        decode = llm.engine.runner.decode.decode
        first = _run(llm, short)
        scores = decode._scratch["scores"].numel()
        grown = _run(llm, wide)
        assert decode._scratch["scores"].numel() > scores  # more rows, longer contexts
        assert _run(llm, short) == first  # a small step in the grown buffers
    with LLM(str(smollm2_gguf), enable_prefix_caching=False) as fresh:
        assert _run(fresh, wide) == grown


def test_a_large_buffer_is_given_back(smollm2_gguf, monkeypatch):
    # the real floor (16 MB) needs a long context; the rule is the same at any size
    monkeypatch.setattr(host_memory, "KEEP_BYTES", 0)
    monkeypatch.setattr(host_memory, "SHRINK", 2)
    short, wide = _prompts(1, 9), _prompts(5, 300)
    with LLM(str(smollm2_gguf), enable_prefix_caching=False) as llm:
        decode = llm.engine.runner.decode.decode
        first = _run(llm, short)
        _run(llm, wide)
        grown = decode._scratch["scores"].numel()
        assert _run(llm, short) == first
        assert decode._scratch["scores"].numel() * 2 <= grown
