"""The real draft/target pair: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (both
Q4_K_M GGUFs assembled from PyPI chunks; ``make setup-slow``). Greedy output is exactly
the target's alone, and the draft is right often enough to matter."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.proposer import DraftHook

pytestmark = pytest.mark.slow

TASKS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python class for a stack with push, pop and peek.",
]


def test_qwen_coder_pair(qwen_coder_gguf, qwen_coder_draft_gguf):
    params = SamplingParams(temperature=0, max_tokens=64)
    convs = [[{"role": "user", "content": t}] for t in TASKS]
    with LLM(str(qwen_coder_gguf), max_model_len=1024) as plain:
        want = [o.outputs[0].token_ids for o in plain.chat(convs, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": str(qwen_coder_draft_gguf),
            "num_speculative_tokens": 4, "adaptive": False}  # fmt: skip
    with LLM(str(qwen_coder_gguf), max_model_len=1024, speculative_config=spec) as llm:
        got = [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]
        (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
        assert got == want
        assert hook.stats.acceptance_rate > 0.4, hook.stats.as_dict()


def test_qwen_coder_pair_int4_draft_low_precision(qwen_coder_gguf, qwen_coder_draft_gguf):
    """The fast CPU setting (the draft requantized to int4, one activation term): greedy
    output is the target's alone in the same precision, and acceptance stays high."""
    params = SamplingParams(temperature=0, max_tokens=64)
    convs = [[{"role": "user", "content": t}] for t in TASKS]
    opts = dict(max_model_len=1024, activation_precision="low")
    with LLM(str(qwen_coder_gguf), **opts) as plain:
        want = [o.outputs[0].token_ids for o in plain.chat(convs, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": str(qwen_coder_draft_gguf),
            "num_speculative_tokens": 4, "quantization": "int4"}  # fmt: skip
    with LLM(str(qwen_coder_gguf), speculative_config=spec, **opts) as llm:
        got = [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]
        (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
        draft = hook.proposer.runner.model
        assert {m.method.name for m in draft.modules() if hasattr(m, "qtiles")} >= {"int4"}
        assert got == want
        assert hook.stats.acceptance_rate > 0.4, hook.stats.as_dict()
