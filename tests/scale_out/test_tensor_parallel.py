"""Tensor parallelism over 2 gloo ranks gives the one-process engine's greedy tokens."""

from __future__ import annotations

import pytest
from scale_out_models import FAMILIES, save_family

from tokenmill import LLM, SamplingParams
from tokenmill.inputs import TokensPrompt

PROMPTS = [
    TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9, 10]),
    TokensPrompt(prompt_token_ids=list(range(100, 141))),  # chunks of 16-token blocks
    TokensPrompt(prompt_token_ids=[300, 7, 300, 7, 42]),
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
SCORED = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)


def _run(path, **options):
    with LLM(str(path), dtype="float32", num_kv_blocks=64, **options) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        scored = llm.generate(PROMPTS[:1], SCORED, use_tqdm=False)[0]
    return [o.outputs[0] for o in outs], scored


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_equals_tp1(family, tmp_path, smollm2_hf_tokenizer):
    path = save_family(family, tmp_path / family, smollm2_hf_tokenizer)
    ref, ref_scored = _run(path)
    got, got_scored = _run(path, tensor_parallel_size=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(got, ref):  # the same distribution, up to the order of float sums
        for pa, pb in zip(a.logprobs, b.logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-3 for t in pa)
    pairs = zip(got_scored.prompt_logprobs[1:], ref_scored.prompt_logprobs[1:])
    assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for a, b in pairs for t in b)
