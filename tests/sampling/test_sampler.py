from __future__ import annotations

import pytest
import torch

from tokenmill.sampling import RowState, Sampler, compute_logprobs, make_generator
from tokenmill.sampling.logits_processors import apply_min_p, apply_penalties
from tokenmill.sampling_params import SamplingParams

V = 32


def row(prompt=(0,), output=(), seed=None, eos=(), **kw) -> RowState:
    params = SamplingParams(seed=seed, **kw)
    gen = make_generator(seed) if seed is not None else None
    return RowState(params, list(prompt), list(output), gen, frozenset(eos))


def rand_logits(n: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = rand_logits(6)
    before = logits.clone()
    out = sampler()(logits, [row(temperature=0.0) for _ in range(6)])
    assert torch.equal(out.token_ids, logits.argmax(-1)) and out.token_ids.dtype == torch.int64
    assert out.logprobs is None and torch.equal(logits, before)


def test_greedy_tie_takes_first_max() -> None:
    logits = torch.zeros(1, V)
    logits[0, [5, 9]] = 1.0
    assert sampler()(logits, [row(temperature=0.0)]).token_ids.tolist() == [5]


def test_empty_batch() -> None:
    assert sampler()(torch.zeros(0, V), []).token_ids.shape == (0,)


def test_greedy_rows_mixed_with_random_rows() -> None:
    logits = rand_logits(6, seed=1)

    def rows(step: int) -> list[RowState]:  # a seeded row's noise is keyed by its position
        return [
            row(output=[0] * step, temperature=0.0 if i % 2 == 0 else 5.0,
                seed=None if i % 2 == 0 else i)
            for i in range(6)
        ]  # fmt: skip

    s = sampler()
    picks = torch.stack([s(logits, rows(step)).token_ids for step in range(30)])  # [30, 6]
    assert torch.equal(picks[:, ::2], logits.argmax(-1)[::2].expand(30, 3))
    assert all(picks[:, i].unique().numel() > 1 for i in (1, 3, 5))  # T=5: really random


@pytest.mark.parametrize("kwargs", [{"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}])
def test_filters_at_their_limit_equal_greedy(kwargs: dict) -> None:
    logits = rand_logits(8, seed=2)
    s = sampler()
    for _ in range(10):
        out = s(logits, [row(temperature=2.0, **kwargs) for _ in range(8)])
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_min_p_masks_below_fraction_of_top() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    apply_min_p(logits, torch.tensor([0.2, 0.7]))
    assert torch.isinf(logits).tolist() == [[False, False, False, True], [False, True, True, True]]
    rows = [row(min_p=0.2) for _ in range(2000)]
    picks = sampler()(probs.log()[:1].expand(2000, 4), rows).token_ids
    assert 3 not in picks.tolist() and set(picks.tolist()) == {0, 1, 2}


def test_top_k_and_top_p_keep_expected_sets() -> None:
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()[None].expand(3000, 5)
    picks_k = sampler()(logits, [row(top_k=2) for _ in range(3000)]).token_ids
    assert set(picks_k.tolist()) == {1, 3}
    # sorted: 0.4, 0.3, 0.15 -> cumulative 0.85 >= 0.8 keeps three tokens
    picks_p = sampler()(logits, [row(top_p=0.8) for _ in range(3000)]).token_ids
    assert set(picks_p.tolist()) == {1, 3, 4}


def _chi_square(picks: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(picks, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * picks.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampling_follows_softmax_of_logits_over_temperature() -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n, temperature = 20000, 0.7
    picks = sampler(seed=123)(base.expand(n, 6), [row(temperature=temperature)] * n).token_ids
    # df = 5: P(chi2 > 30) ~ 1.5e-5; deterministic with the fixed generator anyway
    assert _chi_square(picks, torch.softmax(base / temperature, -1)) < 30
    # top-k then renormalize: the sampled distribution is softmax over the kept tokens
    picks_k = sampler(seed=5)(base.expand(n, 6), [row(top_k=3)] * n).token_ids
    kept = torch.softmax(base.masked_fill(base < 0.5, float("-inf")), -1)  # tokens 0, 1, 5
    assert torch.bincount(picks_k, minlength=6)[kept == 0].sum() == 0
    compact = torch.searchsorted(torch.tensor([0, 1, 5]), picks_k)  # 0, 1, 5 -> 0, 1, 2
    assert _chi_square(compact, kept[[0, 1, 5]]) < 25  # df = 2


def _run_target(target_kwargs: dict, others: list[dict], steps: int = 20) -> list[int]:
    """Generate with a seeded target request, alone or among `others` in shuffled order."""
    model = torch.Generator().manual_seed(99)  # deterministic fake model: logits per step
    order = torch.Generator().manual_seed(7)
    s = sampler(seed=11)
    target = row(output=[], **target_kwargs)
    other_rows = [row(**kw) for kw in others]
    for _ in range(steps):
        target_logits = torch.randn(1, V, generator=model) * 2
        rows = [target] + other_rows
        logits = torch.cat([target_logits, torch.randn(len(other_rows), V) * 2])
        perm = torch.randperm(len(rows), generator=order)
        out = s(logits[perm], [rows[i] for i in perm.tolist()])
        picked = out.token_ids[(perm == 0).nonzero()[0, 0]]
        target.output_token_ids.append(int(picked))
        for r in other_rows:
            r.output_token_ids.append(1)
    return target.output_token_ids


@pytest.mark.parametrize(
    "target",
    [
        {"seed": 1234},
        {"seed": 42, "temperature": 0.8, "top_p": 0.9},
        {"seed": 7, "top_k": 10, "min_p": 0.05, "presence_penalty": 0.5},
    ],
)
def test_seeded_request_independent_of_batch(target: dict) -> None:
    others = [
        {},  # unseeded
        {"seed": 5, "temperature": 1.3, "top_k": 5},  # another seeded request
        {"temperature": 0.0},  # greedy
        {"top_p": 0.5, "min_p": 0.1, "repetition_penalty": 1.3},  # unseeded with filters
    ]
    alone = _run_target(target, [])
    assert alone == _run_target(target, others)
    assert len(set(alone)) > 3  # it really sampled


def test_seeded_row_draws_from_its_generator_seeded_for_the_position() -> None:
    from tokenmill.sampling.sampler import position_seed

    r = row(seed=3, output=[1, 2], temperature=0.7)
    reference = make_generator(position_seed(3, 2))
    sampler()(rand_logits(1), [r])
    torch.empty(V).exponential_(generator=reference)
    assert torch.equal(r.generator.get_state(), reference.get_state())
    # the same position draws the same noise whatever the generator did before
    logits = rand_logits(1, seed=4)
    again = row(seed=3, output=[1, 2], temperature=0.7)
    torch.empty(50).exponential_(generator=again.generator)
    assert sampler()(logits, [r]).token_ids.equal(sampler()(logits, [again]).token_ids)
    assert len({position_seed(3, p) for p in range(1000)} | {position_seed(4, 0)}) == 1001


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = rand_logits(4)
    rows = [row(logit_bias={"17": 100}) for _ in range(4)]
    assert sampler()(logits, rows).token_ids.tolist() == [17] * 4
    top = logits.argmax(-1)
    banned = [row(temperature=0.0, logit_bias={int(t): -100}) for t in top]
    assert not torch.equal(sampler()(logits, banned).token_ids, top)


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0  # eos
    logits[:, 3] = 9.0  # stop token id
    logits[:, 4] = 8.0
    rows = [
        row(temperature=0.0, min_tokens=2, stop_token_ids=[3], eos=[2], output=[9]),
        row(temperature=0.0, min_tokens=2, stop_token_ids=[3], eos=[2], output=[9, 9]),
        row(temperature=0.0, stop_token_ids=[3], eos=[2]),
    ]
    assert sampler()(logits, rows).token_ids.tolist() == [4, 2, 2]


def test_repetition_penalty_formula() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    rows = [
        row(prompt=[0], output=[1, 2, 2], repetition_penalty=2.0),
        row(prompt=[0], output=[1, 2, 2]),
    ]
    apply_penalties(logits, rows)
    # seen in prompt or output: positive halved, negative doubled; row 2 untouched
    assert logits.tolist() == [[1.0, -2.0, 0.25, 3.0], [2.0, -1.0, 0.5, 3.0]]


def test_frequency_and_presence_penalty_formula() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]]).repeat(3, 1)
    rows = [
        row(prompt=[0], output=[1, 2, 2], frequency_penalty=0.5),
        row(prompt=[0], output=[1, 2, 2], presence_penalty=0.5),
        row(
            prompt=[0],
            output=[1, 2, 2],
            frequency_penalty=0.5,
            presence_penalty=1.0,
            repetition_penalty=2.0,
        ),
    ]
    apply_penalties(logits, rows)
    # counts in output = [0, 1, 2, 0]; the prompt token 0 is not penalized by these two
    assert logits.tolist() == [
        [2.0, -1.5, -0.5, 3.0],
        [2.0, -1.5, 0.0, 3.0],
        [1.0, -3.5, -1.75, 3.0],
    ]


def test_presence_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9] + [0.0] * (V - 2)])
    assert sampler()(
        logits, [row(temperature=0.0, output=[0], presence_penalty=0.5)]
    ).token_ids.tolist() == [1]


def test_logprobs_match_log_softmax_of_raw_logits() -> None:
    logits = rand_logits(4, seed=3)
    rows = [
        row(logprobs=5, temperature=0.0, logit_bias={0: 50}),
        row(logprobs=2, temperature=0.5, seed=1),
        row(),
        row(logprobs=0, top_k=3),
    ]
    out = sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    lp = out.logprobs
    assert lp is not None and out.token_ids[0] == 0  # bias applied, logprobs still raw
    assert lp.top_ids.shape == (4, 5) and lp.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(lp.sampled_logprob, ref.gather(1, out.token_ids[:, None])[:, 0])
    top_vals, top_ids = ref.topk(5, -1)
    assert torch.equal(lp.top_ids, top_ids)
    torch.testing.assert_close(lp.top_logprobs, top_vals)
    ranks = (ref > ref.gather(1, out.token_ids[:, None])).sum(-1) + 1
    assert torch.equal(lp.sampled_rank, ranks)


def test_in_place_edits_the_given_logits_and_samples_the_same() -> None:
    """The runner's mode: processors edit its fresh logits instead of a copy. Same tokens
    (seeded random rows too) and the same raw logprobs as with the copy."""
    rows = lambda: [
        row(temperature=0.0, logit_bias={5: 40}, logprobs=3),  # noqa: E731
        row(temperature=0.7, seed=4, top_k=5, logprobs=1),
        row(temperature=0.0, output=[1], repetition_penalty=1.5),
    ]
    logits = rand_logits(3, seed=7)
    before = logits.clone()
    copied = sampler()(logits, rows())
    assert torch.equal(logits, before)
    in_place = sampler()(logits, rows(), in_place=True)
    assert torch.equal(in_place.token_ids, copied.token_ids) and in_place.token_ids[0] == 5
    assert logits[0, 5] == before[0, 5] + 40  # the bias went into the given tensor
    for a, b in zip(in_place.logprobs.__dict__.values(), copied.logprobs.__dict__.values()):
        assert torch.equal(a, b)


def test_logprobs_zero_and_larger_than_vocab() -> None:
    logits = rand_logits(2, vocab=8)
    out = sampler()(logits, [row(logprobs=0, temperature=0.0), row(temperature=0.0)])
    assert out.logprobs.top_ids.shape == (2, 0)
    assert out.logprobs.sampled_rank.tolist() == [1, 1]
    wide = compute_logprobs(logits, 20, torch.tensor([3, 4]))
    assert wide.top_ids.shape == (2, 8)


def test_compute_logprobs_for_prompt_tokens() -> None:
    logits = rand_logits(5, seed=4)  # positions 0..4 predicting prompt[1:6]
    targets = torch.tensor([3, 1, 4, 1, 5])
    out = compute_logprobs(logits, 3, targets)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.sampled_logprob, ref[torch.arange(5), targets])
    assert torch.equal(out.top_ids, ref.topk(3, -1).indices)
