"""The sampler's persistent batch state: the plan made once per batch composition
(``sampling/batch.py``) and the device-resident penalty histories
(``sampling/penalty_history.py``) give exactly what planning and counting from scratch
every step gives."""

from __future__ import annotations

import gc

import torch

from tokenmill.sampling import RowState, Sampler, make_generator
from tokenmill.sampling.in_flight import InFlightRow
from tokenmill.sampling.logits_processors import DEFAULT_PROCESSORS, apply_penalties
from tokenmill.sampling.penalty_history import PenaltyHistories
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.request import Request

V = 48


def request(rid: str, seed: int | None = None, prompt=(1, 2, 3), **kw) -> Request:
    params = SamplingParams(seed=seed, max_tokens=64, **kw)
    req = Request(rid, list(prompt), params, 64, frozenset({0}))
    if seed is not None:
        req.generator = make_generator(seed)
    return req


def mixed_batch() -> list[Request]:
    """Greedy, random, seeded, filtered, biased, min_tokens, penalised and logprob rows."""
    return [
        request("greedy", temperature=0.0),
        request("random", temperature=0.8, top_k=5),
        request("seeded", seed=7, temperature=1.3, top_p=0.8),
        request("min_p", seed=3, temperature=0.9, min_p=0.2),
        request("bias", temperature=0.0, logit_bias={5: 50.0}),
        request("min_tokens", temperature=0.0, min_tokens=3),
        request("rep", temperature=0.0, repetition_penalty=1.8, prompt=(4, 9)),
        request("freq", seed=11, temperature=1.0, frequency_penalty=0.7, presence_penalty=0.4),
        request("logprobs", temperature=0.0, logprobs=3),
    ]


def logits_for(step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    logits = torch.randn(n, V, generator=g) * 2
    logits[:, 0] += 1.0  # EOS is likely: min_tokens must hold it back
    return logits


def clone(req: Request) -> Request:
    twin = request(req.request_id)
    twin.params, twin.prompt_token_ids = req.params, list(req.prompt_token_ids)
    twin.all_token_ids = list(req.all_token_ids)
    twin.output_token_ids = list(req.output_token_ids)
    if req.params.seed is not None:
        twin.generator = make_generator(req.params.seed)
    return twin


def test_planned_batch_equals_fresh_sampler_every_step() -> None:
    """One sampler over 12 steps of the same batch (its plan made once, its histories
    growing) against a new sampler per step on copies of the rows (planned and counted
    from scratch): the same tokens and logprobs, and a tie of the first sort."""
    reqs = mixed_batch()
    steady = Sampler(torch.Generator().manual_seed(0))
    for step in range(12):
        logits = logits_for(step, len(reqs))
        fresh_rows = [clone(r) for r in reqs]
        fresh = Sampler(torch.Generator().manual_seed(step))
        expected = fresh(logits, fresh_rows)
        steady.default_generator = torch.Generator().manual_seed(step)
        got = steady(logits, reqs)
        assert got.token_ids.tolist() == expected.token_ids.tolist(), step
        assert got.logprobs is not None and expected.logprobs is not None
        assert torch.equal(got.logprobs.top_ids, expected.logprobs.top_ids)
        for req, token in zip(reqs, got.token_ids.tolist()):
            req.append_token(token)
    assert steady.plans.num_built == 1
    assert reqs[4].output_token_ids == [5] * 12  # bias
    assert 0 not in reqs[5].output_token_ids[:3]  # min_tokens held EOS back
    assert steady.histories.num_rows_in_use == 2  # the two penalised requests


def test_plan_is_remade_when_the_batch_changes() -> None:
    reqs = mixed_batch()
    s = Sampler(torch.Generator().manual_seed(0))
    s(logits_for(0, len(reqs)), reqs)
    s(logits_for(1, len(reqs)), list(reqs))  # a new list of the same rows: same plan
    assert s.plans.num_built == 1
    fewer = reqs[1:]
    out = s(logits_for(2, len(fewer)), fewer)
    assert s.plans.num_built == 2
    assert out.token_ids[3].item() == 5  # the bias row moved from index 4 to 3


def test_in_flight_row_shares_its_requests_plan() -> None:
    req = request("a", temperature=0.0, frequency_penalty=2.0)
    req.append_token(7)
    s = Sampler()
    s(logits_for(0, 1), [req])
    source = torch.tensor([9])
    logits = torch.zeros(1, V)
    logits[0, 9] = 3.0  # the token in flight: penalised by its count of one, on the device
    logits[0, 8] = 2.5
    out = s(logits, [InFlightRow(req, source, 0)])
    assert s.plans.num_built == 1
    assert out.token_ids.tolist() == [8]


def test_histories_count_incrementally_and_recount_after_a_cut() -> None:
    histories = PenaltyHistories()
    like = torch.zeros(1, V)
    req = request("a", frequency_penalty=1.0)
    for token in (3, 3, 5):
        req.append_token(token)
    counts, seen = histories.gather([req], V, like)
    assert counts[0, 3] == 2 and counts[0, 5] == 1 and counts.sum() == 3
    assert seen[0].nonzero().flatten().tolist() == [1, 2, 3]
    req.append_token(5)
    req.append_token(9)
    counts, _ = histories.gather([req], V, like)
    assert counts[0, 5] == 2 and counts[0, 9] == 1 and counts.sum() == 5
    req.truncate_output(2)  # a stop string cut the outputs: counted again from the list
    counts, _ = histories.gather([req], V, like)
    assert counts[0, 3] == 2 and counts.sum() == 2


def test_history_rows_come_back_when_requests_end() -> None:
    histories = PenaltyHistories()
    like = torch.zeros(1, V)
    reqs = [request(f"r{i}", presence_penalty=1.0) for i in range(8)]
    histories.gather(reqs, V, like)
    assert histories.num_rows_in_use == 8
    pool = histories.counts.shape[0]
    del reqs[:4]
    gc.collect()
    assert histories.num_rows_in_use == 4
    finished = reqs[0]
    from tokenmill.scheduler.request import RequestStatus

    finished.status = RequestStatus.FINISHED_STOPPED
    more = [request(f"s{i}", presence_penalty=1.0) for i in range(5)]
    for i, r in enumerate(more):
        r.append_token(i + 1)
    counts, _ = histories.gather(more, V, like)  # rows reused, the finished one swept
    assert histories.counts.shape[0] == pool
    assert [int(c.nonzero().item()) for c in counts] == [1, 2, 3, 4, 5]  # no stale counts


def test_histories_agree_with_lists_for_a_mixed_selection() -> None:
    """Live requests (histories) and hand-built rows (lists) in one penalised batch."""
    live = request("live", repetition_penalty=1.5, frequency_penalty=0.3, prompt=(2,))
    live.append_token(4)
    live.append_token(4)
    hand = RowState(live.params, [2], [4, 4])
    logits = logits_for(0, 2)
    expected = logits.clone()
    apply_penalties(expected, [hand, hand])
    apply_penalties(logits, [live, hand], histories=PenaltyHistories())
    assert torch.allclose(logits, expected)


def test_default_processors_still_work_as_plain_callables() -> None:
    rows = [RowState(SamplingParams(logit_bias={3: 100.0}), [1], [])]
    logits = torch.zeros(1, V)
    for process in DEFAULT_PROCESSORS:
        process(logits, rows)
    assert logits.argmax().item() == 3
