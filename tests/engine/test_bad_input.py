"""Every bad input is a clear ValueError and the engine keeps serving."""

from __future__ import annotations

import pytest
from faults import fail_launch

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ContextLengthError, ModelLoadError, UnsupportedModelError

OK = SamplingParams(temperature=0, max_tokens=3)


def still_serves(llm):
    out = llm.generate("still alive?", OK)[0]
    assert out.finished and len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", OK, "empty"),
        ({"prompt_token_ids": []}, OK, "empty"),
        ({"prompt_token_ids": [1, 10**9]}, OK, "token ids"),
        ({"prompt_token_ids": [-1]}, OK, "token ids"),
        ({"prompt_token_ids": list(range(10, 300))}, OK, "max_model_len"),
        ("hi", SamplingParams(max_tokens=10_000), "max_tokens"),
        ("hi", SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        ("hi", SamplingParams(logprobs=20, prompt_logprobs=20), None),
        (3.5, OK, "prompt"),
        ([], OK, "prompt"),
    ],
)
def test_bad_request_raises_and_engine_survives(tiny_llm, prompt, params, match):
    if match is None:  # a valid edge case: must work
        tiny_llm.generate(prompt, params)
    else:
        with pytest.raises(ValueError, match=match):
            tiny_llm.generate(prompt, params)
    still_serves(tiny_llm)


def test_context_length_error_is_specific(tiny_llm):
    with pytest.raises(ContextLengthError, match="shorten"):
        tiny_llm.generate({"prompt_token_ids": [5] * 256}, OK)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(logit_bias={1: 500}), "logit_bias"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_wrong_number_of_params(tiny_llm):
    with pytest.raises(ValueError, match="one per prompt"):
        tiny_llm.generate(["a", "b"], [OK, OK, OK])
    still_serves(tiny_llm)


def test_a_failing_step_fails_only_its_requests(tiny_llm, monkeypatch):
    fail_launch(monkeypatch, tiny_llm.engine.runner, call=1)
    out = tiny_llm.generate("will fail", OK)[0]
    assert out.outputs[0].finish_reason == "error" and "boom" in out.error
    monkeypatch.undo()
    still_serves(tiny_llm)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(model="/no/such/model"), ModelLoadError, "/no/such/model"),
        (dict(dtype="int3"), ValueError, "dtype"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
        (dict(bogus_option=1), TypeError, "bogus_option"),
    ],
)
def test_bad_engine_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(**kwargs)


def test_max_model_len_may_only_lower_the_limit(tiny_llama_dir):
    with pytest.raises(ValueError, match="own limit"):
        LLM(str(tiny_llama_dir), max_model_len=10**6)
    with pytest.raises(ValueError, match="KV cache"):
        LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=2, block_size=4)


def test_unknown_architecture_lists_supported(tmp_path, tiny_llama_dir):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        LLM(str(bad))


def test_closed_llm_refuses(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=32, block_size=4)
    llm.close()
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("x", OK)
