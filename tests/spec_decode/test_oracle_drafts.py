"""Draft tokens through the whole engine with an oracle proposer.

Drafts taken from a reference greedy run are all accepted; corrupted drafts (wrong tokens
at random positions) are rejected from there on. Either way the output must be exactly
the plain greedy output, rejected positions must be rolled back (blocks and computed
counts) and the pool must stay consistent after every step.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.spec_decode import DraftHook

PROMPTS = [[1, *range(20 + 7 * i, 20 + 7 * i + n)] for i, n in enumerate((5, 17, 9, 30, 3))]


class OracleProposer:
    """Proposes the reference continuation; ``corrupt`` is the chance that a draft token
    is replaced by a wrong one (the rest of that proposal is then rejected)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], corrupt: float = 0.0,
                 seed: int = 0, vocab: int = 1000) -> None:  # fmt: skip
        self.references = references
        self.corrupt = corrupt
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.proposed = 0

    name = "oracle"
    costly = False

    def propose(self, requests, max_tokens: int) -> list[list[int]]:
        return [self._one(r, max_tokens) for r in requests]

    def finish(self, request) -> None:
        pass

    def _one(self, request, max_tokens: int) -> list[int]:
        ref = self.references[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        drafts = list(ref[done : done + max_tokens])
        for j in range(len(drafts)):
            if self.rng.random() < self.corrupt:
                drafts[j] = (drafts[j] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        self.proposed += len(drafts)
        return drafts


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=64,
             block_size=4, async_scheduling="off") as llm:  # fmt: skip
        yield llm


def plain(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0] for o in outs]


def run(engine: LLMEngine, params, prompts=PROMPTS):
    ids = [engine.add_request(p, params) for p in prompts]
    finals, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [finals[i] for i in ids], steps


def drafting_engine(llm, proposer, k=4, **overrides):
    config = dataclasses.replace(llm.config, check_kv_integrity=True, **overrides)
    return LLMEngine(config, llm.engine.loaded, hooks=[DraftHook(proposer, k)])


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("corrupt", [0.0, 0.3, 1.0])
def test_drafts_give_exactly_the_plain_greedy_output(llm, corrupt):
    expected = plain(llm, GREEDY)
    refs = {tuple(p): e.token_ids for p, e in zip(PROMPTS, expected)}
    proposer = OracleProposer(refs, corrupt=corrupt)
    engine = drafting_engine(llm, proposer)
    got, steps = run(engine, GREEDY)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert [g.text for g in got] == [e.text for e in expected]
    assert proposer.proposed > 0
    plain_steps = 1 + GREEDY.max_tokens - 1  # one prefill step, then a token per step
    if corrupt == 0.0:  # every draft accepted: k + 1 tokens a step
        assert steps <= 1 + -(-(GREEDY.max_tokens - 1) // 5)
    if corrupt == 1.0:  # every draft rejected: one token a step, as without drafts
        assert steps == plain_steps


def test_logprobs_of_accepted_drafts_match_plain_decoding(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    expected = plain(llm, params)
    refs = {tuple(p): e.token_ids for p, e in zip(PROMPTS, expected)}
    got, _ = run(drafting_engine(llm, OracleProposer(refs, corrupt=0.2, seed=3)), params)
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        assert len(g.logprobs) == len(e.logprobs) == 12
        for lg, le in zip(g.logprobs, e.logprobs):
            assert lg.keys() == le.keys()
            for tok in lg:
                assert lg[tok].logprob == pytest.approx(le[tok].logprob, abs=1e-4)
                assert lg[tok].rank == le[tok].rank
        assert g.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-3)


def test_a_stop_inside_a_multi_token_step_cuts_the_output_there(llm, smollm2_hf_tokenizer):
    free = plain(llm, GREEDY)
    refs = {tuple(p): e.token_ids for p, e in zip(PROMPTS, free)}
    # Stop on a token id and on a stop string that the reference output reaches mid-way.
    stop_id = free[1].token_ids[6]
    text = free[3].text
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    for params in (
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_str]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # length in mid-step
    ):
        expected = plain(llm, params)
        got, _ = run(drafting_engine(llm, OracleProposer(refs)), params)
        for g, e in zip(got, expected):
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
                e.token_ids,
                e.text,
                e.finish_reason,
                e.stop_reason,
            )


def test_rollback_under_preemption_and_prefix_hits(llm):
    """A KV cache too small for all five requests at once: drafts, rejections, preemption
    and prefix-cache hits interleave; the output is still the plain one."""
    expected = plain(llm, GREEDY)
    refs = {tuple(p): e.token_ids for p, e in zip(PROMPTS, expected)}
    engine = drafting_engine(llm, OracleProposer(refs, corrupt=0.4, seed=7), k=3, num_kv_blocks=34)
    got, _ = run(engine, GREEDY, PROMPTS + PROMPTS[:2])  # repeats hit the prefix cache
    assert [g.token_ids for g in got] == [e.token_ids for e in expected + expected[:2]]
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.stats.hits > 0


def test_rejected_drafts_free_their_blocks(llm):
    """Drafts that cross into a new block take it for the step; rejected, it is freed."""
    expected = plain(llm, GREEDY)
    refs = {tuple(p): e.token_ids for p, e in zip(PROMPTS, expected)}
    engine = drafting_engine(llm, OracleProposer(refs, corrupt=1.0), k=8)
    prompt = PROMPTS[2]  # 10 tokens: 3 blocks of 4
    rid = engine.add_request(prompt, GREEDY)
    engine.step()  # prefill: 10 tokens, one sampled
    req = engine.scheduler.requests[rid]
    assert len(engine.kv.block_table(rid)) == 3
    engine.step()  # 11 known + 8 drafts scheduled: 19 tokens -> 5 blocks, all drafts rejected
    assert req.num_output_tokens == 2 and req.num_computed_tokens == 11
    assert len(engine.kv.block_table(rid)) == 3  # back to what 11 computed tokens need
    engine.abort(rid)
