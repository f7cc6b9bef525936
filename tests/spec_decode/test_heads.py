"""EAGLE-3 and MTP heads on random weights: every proposal equals the drafts a reference
written here computes from scratch (full attention, no cache, the target's features from
transformers), across catch-ups, batches and prefix-cache hits; the output is plain greedy
decoding whatever the head proposes; bad heads are clear errors."""

from __future__ import annotations

import re

import pytest
import torch
from head_models import eagle3_reference, make_eagle3_head, make_mimo, mtp_reference
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_llama

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError, ModelLoadError
from tokenmill.spec_decode.proposer import DraftHook

AUX = [1, 2, 3]
PROMPTS = [[1, *range(40 + 9 * i, 40 + 9 * i + n)] for i, n in enumerate((5, 23, 11, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
OPTS = dict(dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_hf_tokenizer):
    path = tmp_path_factory.mktemp("eagle-target")
    return make_tiny_llama(path, smollm2_hf_tokenizer, seed=3, num_hidden_layers=4)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_eagle3_head(tmp_path_factory.mktemp("eagle3"), len(smollm2_hf_tokenizer), AUX)


@pytest.fixture(scope="module")
def plain(target_dir):
    with LLM(str(target_dir), **OPTS) as llm:
        yield llm


def hook(llm: LLM) -> DraftHook:
    (h,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
    return h


def run(llm: LLM, params=GREEDY, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def spy(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Record every (known tokens, proposal) the head makes."""
    proposer = hook(llm).proposer
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def recording(requests, k):
        out = propose(requests, k)
        seen.extend((list(r.all_token_ids), list(d)) for r, d in zip(requests, out))
        return out

    proposer.propose = recording  # type: ignore[method-assign]
    return seen


def eagle(folder, k=3, **extra):
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": k,
            "adaptive": False, **extra}  # fmt: skip


def test_eagle3_drafts_equal_the_reference(target_dir, hf_target, eagle_dir, plain):
    want = run(plain)
    with LLM(str(target_dir), speculative_config=eagle(eagle_dir), **OPTS) as llm:
        seen = spy(llm)
        assert run(llm) == want  # batched, drafts verified: plain greedy output
        assert len(seen) >= 4 * 10
        for tokens, drafts in seen[::3]:
            assert drafts == eagle3_reference(eagle_dir, hf_target, tokens, 3), tokens
        stats = hook(llm).stats
        assert stats.num_draft_tokens > 0
        # The same prompts again hit the prefix cache: the head's KV is in the target's
        # blocks, so its proposals are still the reference's.
        seen.clear()
        assert run(llm) == want
        assert llm.engine.kv.stats.hits > 0
        for tokens, drafts in seen[:8]:
            assert drafts == eagle3_reference(eagle_dir, hf_target, tokens, 3), tokens
        assert not hook(llm).proposer._seqs and not hook(llm).proposer.tap.runs
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_eagle3_bin_layout_with_own_embedding(
    tmp_path, target_dir, hf_target, smollm2_hf_tokenizer
):
    folder = make_eagle3_head(tmp_path / "h", len(smollm2_hf_tokenizer), AUX, draft_vocab=512,
                              seed=1, own_embedding=True, as_bin=True)  # fmt: skip
    with LLM(str(target_dir), speculative_config=eagle(folder, k=2), **OPTS) as llm:
        seen = spy(llm)
        run(llm, prompts=PROMPTS[:2])
        for tokens, drafts in seen[::4]:
            assert drafts == eagle3_reference(folder, hf_target, tokens, 2)


def test_eagle3_on_the_native_decode_path(target_dir, eagle_dir):
    """int8 weights: decode and verify steps run the whole-layer native path, whose
    captured features must give the proposals of the per-op path."""
    opts = {**OPTS, "quantization": "int8"}
    with LLM(str(target_dir), **opts) as ref:
        want = run(ref)
    got = []
    for eager in (False, True):
        with LLM(str(target_dir), speculative_config=eagle(eagle_dir), **opts) as llm:
            assert llm.engine.runner.decode is not None  # the whole-layer native path
            if eager:
                llm.engine.runner.decode = None
            seen = spy(llm)
            assert run(llm) == want
            got.append(seen)
    assert got[0] == got[1]


def test_eagle3_composes(target_dir, eagle_dir, plain):
    """Seeded sampling, penalties, logprobs, n > 1, a stop string inside a run, and
    preemption (a KV cache too small for all four), blocks all returned."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, n=2,
                             repetition_penalty=1.2, frequency_penalty=0.3, logprobs=2,
                             ignore_eos=True)  # fmt: skip
    want = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], sampled, use_tqdm=False)
    small = {**OPTS, "num_kv_blocks": 40}
    with LLM(str(target_dir), speculative_config=eagle(eagle_dir), check_kv_integrity=True,
             **small) as llm:  # fmt: skip
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampled, use_tqdm=False)
        for a, b in zip(got, want):
            for x, y in zip(a.outputs, b.outputs):
                assert x.token_ids == y.token_ids
                assert x.logprobs is not None and y.logprobs is not None
                for lx, ly in zip(x.logprobs, y.logprobs):
                    assert lx.keys() == ly.keys()
                    for t in lx:
                        assert abs(lx[t].logprob - ly[t].logprob) < 1e-4
        assert llm.engine.scheduler.num_preemptions > 0
        assert run(llm) == run(plain)
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_mtp_drafts_equal_the_reference(tmp_path, smollm2_hf_tokenizer):
    from transformers import Qwen2ForCausalLM

    folder = make_mimo(tmp_path / "mimo", smollm2_hf_tokenizer, seed=2)
    hf = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with LLM(str(folder), **OPTS) as base:
        want = run(base)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    with LLM(str(folder), speculative_config=spec, **OPTS) as llm:
        seen = spy(llm)
        assert run(llm) == want
        assert len(seen) >= 20
        for tokens, drafts in seen[::3]:
            assert drafts == mtp_reference(folder, hf, tokens, 2), tokens
    greedy = hf.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=20, do_sample=False,
                         min_new_tokens=20)  # fmt: skip
    assert want[1] == greedy[0, len(PROMPTS[1]) :].tolist()  # the MiMo target is Qwen2's


def test_adaptive_heads_keep_the_output(target_dir, eagle_dir, plain):
    with LLM(str(target_dir), speculative_config=eagle(eagle_dir, adaptive=True), **OPTS) as llm:
        assert run(llm) == run(plain)
        assert hook(llm).length.proposal is not None  # the head's own step cost was measured


def test_bad_heads_are_clear_errors(tmp_path, target_dir, eagle_dir, smollm2_hf_tokenizer):
    with pytest.raises(InvalidRequestError, match="num_nextn_predict_layers"):
        LLM(str(target_dir), speculative_config={"method": "mtp"}, **OPTS)
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(target_dir), speculative_config=eagle(tmp_path), **OPTS)
    bad = make_eagle3_head(tmp_path / "b", len(smollm2_hf_tokenizer), [1, 2, 9], seed=4)
    with pytest.raises(ModelLoadError, match="eagle_aux_hidden_state_layer_ids"):
        LLM(str(target_dir), speculative_config=eagle(bad), **OPTS)
    wide = make_eagle3_head(tmp_path / "w", len(smollm2_hf_tokenizer), AUX, seed=5)
    weights = load_file(str(wide / "model.safetensors"))
    weights["d2t"][-1] = len(smollm2_hf_tokenizer) + 10 - (len(weights["d2t"]) - 1)
    save_file(weights, str(wide / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="past the target's vocabulary"):
        LLM(str(target_dir), speculative_config=eagle(wide), **OPTS)


def test_heads_with_grammar_abort_and_async(target_dir, eagle_dir, plain, smollm2_hf_tokenizer):
    """A regex grammar cuts the head's drafts to what it allows; asynchronous scheduling
    gives the same output; an abort mid-speculation returns every block and the head
    forgets the request."""
    from tokenmill.sampling_params import StructuredOutputsParams

    guided = SamplingParams(temperature=0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))  # fmt: skip
    prompts = PROMPTS[:2]
    want_guided = run(plain, guided, prompts)
    want = run(plain)
    with LLM(str(target_dir), speculative_config=eagle(eagle_dir), async_scheduling="on",
             **OPTS) as llm:  # fmt: skip
        assert run(llm, guided, prompts) == want_guided
        texts = [smollm2_hf_tokenizer.decode(t) for t in want_guided]
        assert all(re.fullmatch("[a-z ]+", text) for text in texts), texts
        assert run(llm) == want
        engine = llm.engine
        rid = engine.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=60))
        for _ in range(6):
            engine.step()
        assert hook(llm).stats.num_drafts > 0
        engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        assert not hook(llm).proposer._seqs and not hook(llm).proposer.tap.runs


def test_eagle3_draft_trees(target_dir, hf_target, eagle_dir, plain):
    """draft_top_k=2: the head's chain plus its second guess at each depth, verified in one
    step; the chain is the reference's, the output plain decoding's."""
    spec = eagle(eagle_dir, k=3, draft_top_k=2, verify_tree_size=5)
    with LLM(str(target_dir), speculative_config=spec, **OPTS) as llm:
        proposer = hook(llm).proposer
        trees: list[tuple[list[int], object]] = []
        propose_tree = proposer.propose_tree

        def recording(requests, k, shape):
            out = propose_tree(requests, k, shape)
            trees.extend((list(r.all_token_ids), t) for r, t in zip(requests, out))
            return out

        proposer.propose_tree = recording  # type: ignore[method-assign]
        assert run(llm) == run(plain)
        assert trees and all(len(t.tokens) <= 5 for _, t in trees)
        assert any(not t.is_chain for _, t in trees)
        for tokens, tree in trees[::4]:
            want = eagle3_reference(eagle_dir, hf_target, tokens, 3)
            assert tree.main_chain() == want[: len(tree.main_chain())]
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_tree_configs_are_checked(target_dir, eagle_dir):
    from tokenmill.config import EngineConfig

    with pytest.raises(InvalidRequestError, match="max_verify_tree_size"):
        EngineConfig(speculative_config=eagle(eagle_dir, verify_tree_size=9,
                                              max_verify_tree_size=4))  # fmt: skip
    with pytest.raises(InvalidRequestError, match="draft_step"):
        EngineConfig(speculative_config=eagle(eagle_dir, k=3), draft_step=4)
    with pytest.raises(InvalidRequestError, match="draft_top_k"):
        EngineConfig(speculative_config=eagle(eagle_dir, draft_top_k=0))
    flat = EngineConfig(speculative_config=eagle(eagle_dir, k=2), draft_top_k=3, draft_step=2)
    assert flat.speculative is not None and flat.speculative.is_tree
    assert (flat.speculative.num_speculative_tokens, flat.speculative.tree_nodes) == (2, 6)


def test_feature_runs_are_bounded(monkeypatch):
    from tokenmill.spec_decode import features

    monkeypatch.setattr(features, "MAX_BYTES", 10 * 8 * 4)  # ten rows of 8 floats
    run = features.FeatureRun()
    for start in range(0, 40, 4):
        run.write(start, torch.full((4, 8), float(start)))
    assert run.start >= 28 and run.end == 40  # the oldest pieces went
    run.write(38, torch.zeros(3, 8))  # a rewrite (rejected drafts) drops what follows
    assert run.end == 41 and run.low == 0
    rows = run.take(36, 41)
    assert rows[:, 0].tolist() == [36.0, 36.0, 0.0, 0.0, 0.0]


def test_features_follow_the_accepted_tree_nodes():
    from tokenmill.spec_decode.features import FeatureRun, FeatureTap

    tap = FeatureTap()
    run = tap.runs.setdefault("r", FeatureRun())
    # a recompute chunk: positions 5..7 known (7 the root), then tree nodes 0..3
    run.write(5, torch.arange(7.0)[:, None])
    tap.reorder("r", 7, [0, 1 + 2, 1 + 3])  # the root, then nodes 2 and 3 were accepted
    assert run.take(5, 10)[:, 0].tolist() == [0.0, 1.0, 2.0, 5.0, 6.0]
