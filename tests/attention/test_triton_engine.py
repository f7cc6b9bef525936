"""The engine with attention_backend="triton" (interpreted on CPU, float32) generates what
the reference backend does: chunked prefill, a shared cached prefix, batched decodes."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tokenmill import LLM, SamplingParams  # noqa: E402


def _generate(model_dir, backend: str) -> list[list[int]]:
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", attention_backend=backend,
        max_model_len=128, num_kv_blocks=48, block_size=4, long_prefill_token_threshold=8,
    )  # fmt: skip
    try:
        assert llm.engine.runner.backend.name == backend
        base = list(range(10, 30))
        prompts = [base, base[:12] + [7, 8, 9], [5, 6]]  # 2nd reuses 3 cached blocks of the 1st
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        first = llm.generate(prompts[:1], params)  # fills the prefix cache
        rest = llm.generate(prompts[1:], params)
        return [list(o.outputs[0].token_ids) for o in first + rest]
    finally:
        llm.close()


def test_engine_greedy_matches_reference(tiny_llama_dir):
    assert _generate(tiny_llama_dir, "triton") == _generate(tiny_llama_dir, "reference")
