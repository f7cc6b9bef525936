from __future__ import annotations

import math

import pytest

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (
        16,
        0,
        None,
        None,
        None,
    )
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE


def test_normalization() -> None:
    p = SamplingParams(
        stop="###",
        stop_token_ids=(7, 8),
        top_k=-1,
        seed=-1,
        logit_bias={"12": 3, 5: -1.5},
        temperature=2,
        logprobs=0,
    )
    assert p.stop == ["###"] and p.stop_token_ids == [7, 8]
    assert p.top_k == 0 and p.seed is None
    assert p.logit_bias == {12: 3.0, 5: -1.5}
    assert isinstance(p.temperature, float) and p.logprobs == 0
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": 1.5}, "n must be an int, got 1.5"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": math.nan}, "temperature must be a finite number, got nan"),
        ({"temperature": math.inf}, "temperature must be a finite number, got inf"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be >= -1 (0 or -1 disables it), got -2"),
        ({"top_k": 2.5}, "top_k must be an int, got 2.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 or None, got 0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens must be <= max_tokens=5, got 10"),
        ({"logprobs": 21}, "logprobs must be in [0, 20] or None, got 21"),
        ({"logprobs": -1}, "logprobs must be in [0, 20] or None, got -1"),
        ({"logprobs": True}, "logprobs must be an int, got True"),
        ({"prompt_logprobs": 25}, "prompt_logprobs must be in [0, 20] or None, got 25"),
        (
            {"logit_bias": {i: 1.0 for i in range(1025)}},
            "logit_bias has 1025 entries, at most 1024 are allowed",
        ),
        ({"logit_bias": {3: 150}}, "logit_bias[3] must be in [-100, 100], got 150.0"),
        ({"logit_bias": {"3": -101}}, "logit_bias[3] must be in [-100, 100], got -101.0"),
        ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids (integers), got 'abc'"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict, got list"),
        ({"seed": "x"}, "seed must be an int, got 'x'"),
        ({"seed": 2**64}, "seed must be in ["),
        ({"stop": ["ok", ""]}, "stop must contain only non-empty strings, got ''"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0, got -1"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids entry must be an int, got 'a'"),
        ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind, got 'delta'"),
    ],
)
def test_validation_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_verify_for_vocab() -> None:
    SamplingParams(logit_bias={0: 1, 99: 1}, stop_token_ids=[99]).verify_for_vocab(100)
    with pytest.raises(InvalidRequestError, match=r"logit_bias token id 100 is out of range"):
        SamplingParams(logit_bias={100: 1}).verify_for_vocab(100)
    with pytest.raises(InvalidRequestError, match=r"logit_bias token id -1 .*\[0, 100\)"):
        SamplingParams(logit_bias={-1: 1}).verify_for_vocab(100)
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids token id 500"):
        SamplingParams(stop_token_ids=[5, 500]).verify_for_vocab(100)


def test_sampling_type_and_greedy_normalization() -> None:
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.3, seed=1)
    assert greedy.is_greedy and greedy.sampling_type is SamplingType.GREEDY
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams().sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], logit_bias={1: 2.0})
    q = p.clone()
    q.stop.append("y")
    q.logit_bias[3] = 1.0
    assert (
        p.stop == ["x"]
        and p.logit_bias == {1: 2.0}
        and q == SamplingParams(stop=["x", "y"], logit_bias={1: 2.0, 3: 1.0})
    )


def test_from_generation_config() -> None:
    gen_cfg = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "min_p": None,
        "max_new_tokens": 512,
        "do_sample": True,
        "eos_token_id": 2,
    }
    p = SamplingParams.from_generation_config(gen_cfg)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.05)
    assert p.min_p == 0.0 and p.max_tokens == 16
    q = SamplingParams.from_generation_config(gen_cfg, temperature=0.0, max_tokens=8)
    assert q.is_greedy and q.max_tokens == 8
    assert SamplingParams.from_generation_config({}) == SamplingParams()
    with pytest.raises(InvalidRequestError, match="top_p must be in"):
        SamplingParams.from_generation_config({"top_p": 0})
