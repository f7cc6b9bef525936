"""Draft trees through the whole engine with an oracle: random trees that hide the
reference continuation on one branch among decoys. The output must be exactly plain
decoding (greedy, seeded sampling, logprobs), accepted nodes off the first branch must
have their K/V moved (the next steps read it), and every block comes back; the per-node
attention of the native kernel equals the reference's."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.scheduler.draft_tree import DraftTree, accept, accepted_moves, depths
from tokenmill.spec_decode import DraftHook
from tokenmill.spec_decode.proposer import TreeShape

PROMPTS = [[1, *range(20 + 7 * i, 20 + 7 * i + n)] for i, n in enumerate((5, 17, 9, 30, 3))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def hidden_tree(ref: list[int], nodes: int, rng: random.Random, vocab: int) -> DraftTree:
    """``nodes`` nodes: the tokens of ``ref`` down one branch, in random places among decoys
    (random tokens under random nodes)."""
    tokens: list[int] = []
    parents: list[int] = []
    true_parent, depth = -1, 0
    for _ in range(nodes):
        if depth < len(ref) and rng.random() < 0.45:
            tokens.append(ref[depth])
            parents.append(true_parent)
            true_parent, depth = len(tokens) - 1, depth + 1
        else:
            parents.append(rng.randrange(-1, len(tokens)))
            tokens.append(rng.randrange(vocab))
    return DraftTree(tuple(tokens), tuple(parents))


class TreeOracle:
    name = "tree-oracle"
    costly = False

    def __init__(self, references: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        self.references = references
        self.rng = random.Random(seed)
        self.trees = 0

    def propose(self, requests, k: int) -> list[list[int]]:
        raise AssertionError("a tree hook asks for trees")

    def propose_tree(self, requests, k: int, shape: TreeShape) -> list[DraftTree]:
        out = []
        for r in requests:
            ref = self.references[tuple(r.prompt_token_ids)]
            done = r.num_output_tokens
            out.append(hidden_tree(list(ref[done : done + k]), shape.nodes, self.rng, 1000))
        self.trees += len(out)
        return out

    def finish(self, request) -> None:
        pass


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=96,
             block_size=4, async_scheduling="off") as llm:  # fmt: skip
        yield llm


def outputs(llm_or_engine, params, prompts=PROMPTS):
    if isinstance(llm_or_engine, LLM):
        outs = llm_or_engine.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs for o in outs]
    engine = llm_or_engine
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [finals[i] for i in ids]


def tree_engine(llm, proposer, k=4, nodes=9, **overrides):
    config = dataclasses.replace(llm.config, check_kv_integrity=True, **overrides)
    hook = DraftHook(proposer, k, tree=TreeShape(top_k=2, nodes=nodes))
    return LLMEngine(config, llm.engine.loaded, hooks=[hook]), hook


def test_tree_helpers():
    tree = DraftTree((5, 6, 7, 8), (-1, -1, 1, 2))
    assert depths(tree.parents) == [1, 1, 2, 3] and tree.main_chain() == [5]
    assert not tree.is_chain and DraftTree.chain([1, 2]).is_chain
    # root samples 6 -> node 1; node 1 samples 7 -> node 2; node 2 samples 9: stop
    assert accept(tree.tokens, tree.parents, [6, 0, 7, 9, 0]) == [1, 2]
    assert accepted_moves(10, [1, 2]) == [(12, 11), (13, 12)]
    with pytest.raises(ValueError):
        DraftTree((1, 2), (1, -1))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_trees_give_exactly_the_plain_output(llm, tiny_llama_dir, quantization, monkeypatch):
    """float32 (the eager path, reference attention) and int8 (the whole-layer native
    path with the tree keys in the kernel)."""
    from tokenmill.worker import model_runner

    moved: list[int] = []
    move = model_runner.move_kv

    def counting(caches, src, dst):
        moved.append(len(src))
        move(caches, src, dst)

    monkeypatch.setattr(model_runner, "move_kv", counting)
    base = llm
    if quantization != "none":
        base = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=96,
                   block_size=4, async_scheduling="off", quantization=quantization)  # fmt: skip
    try:
        expected = outputs(base, GREEDY)
        refs = {tuple(p): e[0].token_ids for p, e in zip(PROMPTS, expected)}
        proposer = TreeOracle(refs)
        engine, hook = tree_engine(base, proposer)
        if quantization != "none":
            assert engine.runner.decode is not None  # the native path takes tree steps
        got = outputs(engine, GREEDY)
        assert [g[0].token_ids for g in got] == [e[0].token_ids for e in expected]
        stats = hook.stats
        assert proposer.trees > 0 and stats.num_accepted_tokens > len(PROMPTS) * 4
        assert sum(moved) > 10  # accepted nodes off the first branch: their K/V moved
    finally:
        if base is not llm:
            base.close()


def test_seeded_sampling_and_logprobs_through_trees(llm):
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=16, n=2, logprobs=2,
                            repetition_penalty=1.1, ignore_eos=True)  # fmt: skip
    expected = outputs(llm, params)
    greedy = outputs(llm, GREEDY)
    # drafts from the greedy run: partly right for sampled outputs, never wrong in effect
    refs = {tuple(p): e[0].token_ids for p, e in zip(PROMPTS, greedy)}
    engine, _ = tree_engine(llm, TreeOracle(refs, seed=2))
    got = outputs(engine, params)
    for g, e in zip(got, expected):
        for x, y in zip(g, e):
            assert x.token_ids == y.token_ids
            for lx, ly in zip(x.logprobs, y.logprobs):
                assert lx.keys() == ly.keys()
                for t in lx:
                    assert lx[t].logprob == pytest.approx(ly[t].logprob, abs=1e-4)


def test_trees_with_preemption_return_every_block(llm):
    expected = outputs(llm, GREEDY)
    refs = {tuple(p): e[0].token_ids for p, e in zip(PROMPTS, expected)}
    engine, _ = tree_engine(llm, TreeOracle(refs, seed=5), num_kv_blocks=34)
    assert [g[0].token_ids for g in outputs(engine, GREEDY)] == [e[0].token_ids for e in expected]
    assert engine.scheduler.num_preemptions > 0


def test_native_tree_attention_equals_the_reference():
    from tokenmill import native
    from tokenmill.attention import AttentionMetadata
    from tokenmill.attention.reference import attend

    if not native.available():
        pytest.skip("native kernels unavailable here")
    gen = torch.Generator().manual_seed(0)
    heads, kvh, d, bs, nb = 4, 2, 16, 4, 12
    cache = torch.randn(2, nb, bs, kvh, d, generator=gen)
    rows = 5
    qkv = torch.randn(rows, (heads + 2 * kvh) * d, generator=gen)
    tables = torch.tensor([[3, 7, 1, 0], [3, 7, 1, 0], [5, 2, 0, 0], [3, 7, 1, 0], [5, 2, 0, 0]])
    lens = torch.tensor([9, 9, 6, 9, 7])
    extra = torch.tensor([[30, 31, -1], [29, -1, -1], [-1, -1, -1], [30, 12, 13], [8, -1, -1]])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.int64), query_start_loc=tuple(range(rows + 1)),
        seq_lens=tuple(lens.tolist()), block_tables=tables, block_size=bs, seq_lens_tensor=lens,
        extra_slots=extra,
    )  # fmt: skip
    got = native.decode_attention(qkv, heads, kvh, d, cache, tables, lens, 9, d**-0.5, None,
                                  extra)  # fmt: skip
    q = qkv[:, : heads * d].view(rows, heads, d)
    kv = qkv[:, heads * d :].view(rows, 2, kvh, d)
    want = attend(q, kv, cache, meta, d**-0.5).reshape(rows, heads * d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and against attention written out: row 3 sees its 9 context keys and slots 30, 12, 13
    flat = cache.view(2, nb * bs, kvh, d)
    ctx = [3 * bs + i for i in range(4)] + [7 * bs + i for i in range(4)] + [1 * bs]
    keys = flat[:, ctx + [30, 12, 13]]  # [2, 12, KVH, D]
    k = keys[0].repeat_interleave(heads // kvh, 1)
    v = keys[1].repeat_interleave(heads // kvh, 1)
    w = torch.einsum("hd,khd->hk", q[3], k).mul(d**-0.5).softmax(-1)
    torch.testing.assert_close(got[3].view(heads, d), torch.einsum("hk,khd->hd", w, v),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_trees_on_the_triton_backend(tiny_llama_dir):
    """The triton backend (interpreted on CPU) hands tree steps' attention to the PyTorch
    code that has the per-node keys; the output is still plain decoding."""
    pytest.importorskip("triton")
    from tokenmill.attention.backends import triton_interpreted

    if torch.cuda.is_available() or not triton_interpreted():
        pytest.skip("CPU run of the Triton kernels under TRITON_INTERPRET=1")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(tiny_llama_dir), dtype="float32", device="cpu", attention_backend="triton",
             max_model_len=64, num_kv_blocks=64, block_size=4) as llm:  # fmt: skip
        expected = outputs(llm, params, PROMPTS[:2])
        refs = {tuple(p): e[0].token_ids for p, e in zip(PROMPTS, expected)}
        engine, hook = tree_engine(llm, TreeOracle(refs, seed=8), nodes=6)
        got = outputs(engine, params, PROMPTS[:2])
        assert [g[0].token_ids for g in got] == [e[0].token_ids for e in expected]
        assert hook.stats.num_accepted_tokens > 0


def test_suffix_trees_branch_where_the_context_did():
    from tokenmill.scheduler.request import Request
    from tokenmill.spec_decode.suffix import SuffixProposer

    # after (1, 7, 8), the longest context matching the end, came 9 and 5; then 3 and 6
    tokens = [1, 7, 8, 9, 3, 1, 7, 8, 5, 6, 1, 7, 8]
    req = Request("r", tokens, SamplingParams(max_tokens=4), 1 << 30, frozenset())
    proposer = SuffixProposer(min_token_prob=0.05)
    (tree,) = proposer.propose_tree([req], 3, TreeShape(top_k=2, nodes=5))
    assert tree.tokens[:2] == (9, 5) and tree.parents[:2] == (-1, -1)
    assert tree.main_chain() == [9, 3, 1]
    assert (6, 1) in zip(tree.tokens, tree.parents)  # the branch continues under 5
    (chain,) = proposer.propose([req], 3)
    assert chain == [9, 3, 1]


def test_the_adaptive_cap_counts_tree_nodes():
    """A tree's verification costs all its nodes: where a chain of k drafts pays, a tree
    of many more nodes with the same first branch may not."""
    from tokenmill.spec_decode.adaptive import CostCurve, DraftLength

    curve = CostCurve.from_points({1: 1.0, 2: 1.1, 3: 1.2, 5: 1.4, 9: 3.0, 17: 6.0})
    length = DraftLength(4, curve)
    assert length.choose(0, [0.6], [4]) >= 2  # a chain of 4 at 60%: worth drafting
    heavy = [[4, 8, 12, 16]]  # 4 nodes per depth
    assert length.choose(0, [0.6], [4], heavy) < length.choose(0, [0.6], [4])


def test_ngram_trees_branch_where_earlier_occurrences_did():
    from tokenmill.scheduler.request import Request
    from tokenmill.spec_decode.ngram import NgramProposer, continuation_tree

    # (4, 5) was followed by 6 7, then by 8 9, then by 6 3: latest first, most frequent first
    tokens = [4, 5, 6, 7, 1, 4, 5, 8, 9, 2, 4, 5, 6, 3, 0, 4, 5]
    req = Request("r", tokens, SamplingParams(max_tokens=4), 1 << 30, frozenset())
    proposer = NgramProposer(2, 3)
    (tree,) = proposer.propose_tree([req], 2, TreeShape(top_k=2, nodes=6))
    assert tree.tokens[:2] == (6, 8) and tree.parents[:2] == (-1, -1)
    assert {(3, 0), (7, 0), (9, 1)} <= set(zip(tree.tokens, tree.parents))
    assert proposer.propose([req], 2) == [[6, 3]]  # the chain: the latest occurrence
    small = continuation_tree([[1, 2], [1, 3], [5]], TreeShape(top_k=1, nodes=5))
    assert small.tokens == (1, 2) and small.parents == (-1, 0)
