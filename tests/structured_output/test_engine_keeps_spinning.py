"""Structured output's helper threads (bitmask fill, grammar compiles) let go of the OpenMP
workers their torch ops start: held, they made libgomp stop spin-waiting in the engine's
team for the rest of the process (decode measured at half speed after one batch)."""

from __future__ import annotations

from openmp_probe import on_linux, run_probe


@on_linux
def test_a_structured_batch_leaves_the_engine_spinning(tiny_llama_dir):
    out = run_probe(f"""
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

llm = LLM({str(tiny_llama_dir)!r}, dtype="float32", max_model_len=256, num_kv_blocks=256,
          block_size=4)
params = SamplingParams(temperature=0, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(json={{"type": "object"}}))
before = sleeps_per_op()
llm.generate(["x"] * 32, params, use_tqdm=False)
print(before, sleeps_per_op())
""")
    before, after = map(float, out.split())
    assert after < 0.5, (before, after)  # throttled: ~1 or more per op
