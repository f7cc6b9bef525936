"""Pipeline parallelism over 2 gloo ranks (one stage each) gives the one-process tokens."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_synth import synthetic_tensors, write_gguf
from scale_out_models import FAMILIES, save_family

from tokenmill import LLM, SamplingParams
from tokenmill.distributed.stages import split_layers
from tokenmill.inputs import TokensPrompt

PROMPTS = [
    TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9, 10]),
    TokensPrompt(prompt_token_ids=list(range(100, 141))),
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)


def _run(path, **options):
    with LLM(str(path), num_kv_blocks=64, **options) as llm:
        return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_pp2_greedy_equals_pp1(family, tmp_path, smollm2_hf_tokenizer):
    path = save_family(family, tmp_path / family, smollm2_hf_tokenizer)
    ref = _run(path, dtype="float32")
    got = _run(path, dtype="float32", pipeline_parallel_size=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(got, ref):  # the same layers in the same order: the same floats
        assert [{t: p.logprob for t, p in d.items()} for d in a.logprobs] == [
            {t: p.logprob for t, p in d.items()} for d in b.logprobs
        ]


def test_quantized_gguf_stages_keep_their_formats(tmp_path, smollm2_hf_tokenizer):
    tok = tmp_path / "tok"
    smollm2_hf_tokenizer.save_pretrained(tok)
    path = write_gguf(tmp_path / "m.gguf", synthetic_tensors([Q.Q4_0, Q.Q8_0, Q.Q4_K]))
    prompts = [TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9])]

    def tokens(**options):
        with LLM(str(path), tokenizer=str(tok), num_kv_blocks=32, **options) as llm:
            return llm.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    assert tokens(pipeline_parallel_size=2) == tokens()


def test_layer_split_and_too_many_stages():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more than the model's 2"):
        split_layers(2, 3)


def test_more_stages_than_layers_is_refused_before_any_worker(tmp_path, smollm2_hf_tokenizer):
    path = save_family("llama_tied", tmp_path / "m", smollm2_hf_tokenizer)
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        LLM(str(path), pipeline_parallel_size=3)


LONG = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 300 + 5 for j in range(90 + 40 * i)])
        for i in range(3)]  # fmt: skip


def test_micro_batched_prefill_equals_pp1(tmp_path, smollm2_hf_tokenizer):
    """A 330-row prefill step is cut into 2 micro-batches inside a prompt: the stages
    overlap, and the tokens are the one-process ones. The floats agree to rounding, not
    bit for bit (smaller GEMMs; the cut prompt's second piece attends through the cache)."""
    path = save_family("llama_tied", tmp_path / "m", smollm2_hf_tokenizer)

    def run(**options):
        with LLM(str(path), num_kv_blocks=64, dtype="float32", **options) as llm:
            return [o.outputs[0] for o in llm.generate(LONG, GREEDY, use_tqdm=False)]

    ref, got = run(), run(pipeline_parallel_size=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(got, ref):
        for mine, theirs in zip(a.logprobs, b.logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)
