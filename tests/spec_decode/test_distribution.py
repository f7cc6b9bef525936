"""Sampling with drafts keeps the target distribution (real SmolLM2, unseeded rows).

Drafts are the greedy continuation (what a good proposer guesses), so they matter where
a sample follows it: the statistic is, for m = 0..2, the fraction of samples whose first
m + 1 tokens are the greedy ones (binomial: its noise is known, unlike a marginal over
many tokens). With verification each fraction must match plain sampling within a bound;
the same bound fails for a wrong acceptance rule (accepting every draft), checked too.
"""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.spec_decode.proposer import DraftHook

N = 120
POSITIONS = 3
BOUND = 0.17
"""The difference of two fractions of N samples has a standard deviation of at most
sqrt(2 * 0.25 / N) ~ 0.065: the bound is ~2.6 of them. Accepting every draft makes every
fraction equal the first (~0.6 here), far above the true ones (~0.3 at m = 2)."""
PARAMS = SamplingParams(temperature=1.0, top_k=4, max_tokens=POSITIONS, n=N, ignore_eos=True)
CONV = [{"role": "user", "content": "Name any animal you like, then say why."}]


class GreedyProposer:
    name = "greedy"
    costly = False

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation

    def propose(self, requests, k):
        return [self.continuation[r.num_output_tokens : r.num_output_tokens + k] for r in requests]

    def finish(self, request) -> None:
        pass


def sample(engine: LLMEngine, prompt: list[int]) -> list[list[int]]:
    engine.add_request(prompt, PARAMS, request_id="r")
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    return [o.token_ids for o in final.outputs]


def follows(samples: list[list[int]], greedy: list[int], m: int) -> float:
    """Fraction of samples whose first m + 1 tokens are greedy's."""
    return sum(s[: m + 1] == greedy[: m + 1] for s in samples) / len(samples)


def gaps(a: list[list[int]], b: list[list[int]], greedy: list[int]) -> list[float]:
    return [abs(follows(a, greedy, m) - follows(b, greedy, m)) for m in range(POSITIONS)]


@pytest.fixture(scope="module")
def setup(smollm2_gguf):
    with LLM(str(smollm2_gguf), max_model_len=256, seed=3) as llm:
        prompt = llm.tokenizer.apply_chat_template(CONV, add_generation_prompt=True)
        greedy = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16),
            use_tqdm=False,
        )[0].outputs[0].token_ids  # fmt: skip
        plain = sample(llm.engine, prompt)
        yield llm, prompt, list(greedy), plain


def drafting(llm: LLM, greedy: list[int], seed: int) -> LLMEngine:
    config = dataclasses.replace(llm.config, seed=seed)
    return LLMEngine(config, llm.engine.loaded, hooks=[DraftHook(GreedyProposer(greedy), 3)])


def test_verified_drafts_keep_the_distribution(setup):
    llm, prompt, greedy, plain = setup
    engine = drafting(llm, greedy, seed=11)
    spec = sample(engine, prompt)
    (hook,) = [h for h in engine.hooks if isinstance(h, DraftHook)]
    assert hook.stats.num_accepted_tokens > 0 and hook.stats.acceptance_rate < 1.0
    assert 0.05 < follows(plain, greedy, POSITIONS - 1) < 0.95  # not degenerate
    distances = gaps(plain, spec, greedy)
    assert max(distances) < BOUND, distances


def test_a_wrong_acceptance_rule_fails_the_same_bound(setup, monkeypatch):
    import tokenmill.worker.model_runner as runner

    llm, prompt, greedy, plain = setup
    monkeypatch.setattr(runner, "verify_drafts", lambda drafts, sampled: [*drafts, sampled[-1]])
    spec = sample(drafting(llm, greedy, seed=11), prompt)
    wrong = gaps(plain, spec, greedy)
    assert max(wrong) >= BOUND


class TrieProposer:
    """Draft trees from a trie of sample prefixes: under a request's outputs so far, its
    most frequent continuations (several branches per position)."""

    name = "trie"
    costly = False

    def __init__(self, samples: list[list[int]]) -> None:
        self.counts: dict[tuple[int, ...], int] = {}
        for s in samples:
            for m in range(1, len(s) + 1):
                self.counts[tuple(s[:m])] = self.counts.get(tuple(s[:m]), 0) + 1

    def propose(self, requests, k):
        raise AssertionError("a tree hook asks for trees")

    def propose_tree(self, requests, k, shape):
        from tokenmill.scheduler.draft_tree import DraftTree

        trees = []
        for r in requests:
            base = tuple(r.output_token_ids)
            frontier, tokens, parents = [(base, -1)], [], []
            while frontier and len(tokens) < shape.nodes:
                prefix, node = frontier.pop(0)
                kids = sorted(
                    (
                        (c, p)
                        for p, c in self.counts.items()
                        if len(p) == len(prefix) + 1 and p[:-1] == prefix
                    ),
                    reverse=True,
                )
                for _, p in kids[:2]:  # fmt: skip
                    if len(tokens) < shape.nodes:
                        tokens.append(p[-1])
                        parents.append(node)
                        frontier.append((p, len(tokens) - 1))
            trees.append(DraftTree(tuple(tokens), tuple(parents)))
        return trees

    def finish(self, request) -> None:
        pass


def tree_drafting(llm: LLM, samples: list[list[int]], seed: int) -> LLMEngine:
    from tokenmill.spec_decode.proposer import TreeShape

    config = dataclasses.replace(llm.config, seed=seed)
    hook = DraftHook(TrieProposer(samples), 3, tree=TreeShape(top_k=2, nodes=6))
    return LLMEngine(config, llm.engine.loaded, hooks=[hook])


def test_verified_trees_keep_the_distribution(setup):
    """Trees of the plain samples' own branches: every sample is drawn from the target's
    distribution after its path, so the fractions match plain sampling."""
    llm, prompt, greedy, plain = setup
    engine = tree_drafting(llm, plain, seed=13)
    spec = sample(engine, prompt)
    (hook,) = [h for h in engine.hooks if isinstance(h, DraftHook)]
    assert hook.stats.num_accepted_tokens > 0
    distances = gaps(plain, spec, greedy)
    assert max(distances) < BOUND, distances


def test_a_wrong_tree_rule_fails_the_same_bound(setup, monkeypatch):
    """Taking the first branch's drafts whatever was sampled skews the distribution."""
    import tokenmill.worker.model_runner as runner

    llm, prompt, greedy, plain = setup

    def first_branch(tokens, parents, sampled):
        out, node = [], -1
        while (child := next((j for j, p in enumerate(parents) if p == node), None)) is not None:
            out.append(child)
            node = child
        return out

    monkeypatch.setattr(runner, "accept", first_branch)
    spec = sample(tree_drafting(llm, plain, seed=13), prompt)
    assert max(gaps(plain, spec, greedy)) >= BOUND
