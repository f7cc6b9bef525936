"""The default CPU path (SmolLM2 Q4_1 kept quantized) against the dequantized float32
reference: greedy tokens and held-out logprobs.

The bar: at least 16 greedy tokens equal in most prompts, and the mean per-token
logprob of a held-out text within 0.05.
"""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.quant.plan import auto_dtype

PROMPTS = [
    "The history of the Roman Empire is long and complicated. It began when",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here is a list of the planets of the solar system, in order from the sun:",
    "Question: Why do leaves change colour in autumn? Answer:",
    "The recipe for a simple tomato sauce starts with",
    "In 1969, the Apollo 11 mission",
    "To install the package, open a terminal and run",
    "Photosynthesis is the process by which",
]
HELD_OUT = (
    "The lighthouse stood at the edge of the cliff for more than a century. Every night its "
    "keeper climbed the spiral stairs, trimmed the wick and wound the clockwork that turned "
    "the great lens. Ships passing the headland counted the flashes to know where they were, "
    "and in the worst storms the keeper stayed awake until dawn, watching the beam sweep "
    "across the water. When the light was finally automated, the village held a small "
    "ceremony, and the last keeper handed the brass key to the mayor."
)
N_TOKENS = 32


@pytest.fixture(scope="module")
def engines():
    quantized = LLM(max_model_len=512)  # the defaults: what a CPU user gets
    reference = LLM(dtype="float32", quantization="none", max_model_len=512)
    yield quantized, reference
    quantized.close()
    reference.close()


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def held_out_logprobs(llm: LLM) -> list[float]:
    ids = llm.tokenizer.encode(HELD_OUT)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    return [d[t].logprob for d, t in zip(out.prompt_logprobs, ids) if d]


def test_default_cpu_path_is_quantized(engines) -> None:
    loaded = engines[0].engine.loaded
    assert loaded.quantization == "gguf" and loaded.dtype == auto_dtype()
    assert engines[1].engine.loaded.quantization == "none"


def test_greedy_tokens_follow_the_reference(engines) -> None:
    quantized, reference = engines
    prompts = [quantized.tokenizer.encode(p) for p in PROMPTS]
    matched = [
        common_prefix(a, b) for a, b in zip(greedy(quantized, prompts), greedy(reference, prompts))
    ]
    print("greedy tokens matching the reference, per prompt:", matched)
    assert sum(m >= 16 for m in matched) >= 0.75 * len(prompts), matched


def test_held_out_logprob_within_005(engines) -> None:
    quantized, reference = engines
    q, r = held_out_logprobs(quantized), held_out_logprobs(reference)
    assert len(q) == len(r) > 50
    diff = abs(sum(q) / len(q) - sum(r) / len(r))
    print(
        f"mean logprob: quantized {sum(q) / len(q):.6f}, "
        f"reference {sum(r) / len(r):.6f}, diff {diff:.2e}"
    )
    assert diff < 0.05, diff
