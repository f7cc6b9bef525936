"""Speculative decoding end to end on the real SmolLM2 (GGUF, native CPU path): every
method gives exactly the output of plain decoding, alone and composed with the other
features; seeded sampling gives the same tokens with or without drafts.

``adaptive=False`` drafts up to k tokens at every step (the adaptive cap could turn
speculation off on a loaded test machine, and then nothing would be verified).
"""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.spec_decode.proposer import DraftHook

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
)
COPY = [{"role": "user", "content": "Repeat this text exactly, word for word:\n\n" + TEXT}]
OTHER = [{"role": "user", "content": "Write a short list of three fruits and their colours."}]
GREEDY = SamplingParams(temperature=0, max_tokens=48)
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
    "suffix-tree": {
        "method": "suffix",
        "num_speculative_tokens": 4,
        "adaptive": False,
        "draft_top_k": 2,
        "verify_tree_size": 8,
    },  # fmt: skip
}


def _llm(smollm2_gguf, spec=None, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    return LLM(str(smollm2_gguf), speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(smollm2_gguf):
    with _llm(smollm2_gguf) as llm:
        yield llm


@pytest.fixture(scope="module", params=sorted(METHODS))
def spec(request, smollm2_gguf):
    with _llm(smollm2_gguf, METHODS[request.param]) as llm:
        yield llm


def hook(llm: LLM) -> DraftHook:
    (found,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
    return found


def chat(llm: LLM, convs, params):
    return [o.outputs[0] for o in llm.chat(convs, params, use_tqdm=False)]


def test_greedy_output_is_unchanged_and_drafts_are_accepted(plain, spec):
    before = hook(spec).stats.num_accepted_tokens
    want = chat(plain, [COPY, OTHER], GREEDY)
    got = chat(spec, [COPY, OTHER], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert hook(spec).stats.num_accepted_tokens - before >= 10  # the copy really speculated
    metrics = spec.get_scheduling_metrics()
    assert metrics["spec_decode_num_draft_tokens"] >= metrics["spec_decode_num_accepted_tokens"]
    assert 1.0 <= metrics["spec_decode_mean_acceptance_length"] <= 5.0


def test_batched_equals_single(spec):
    single = [chat(spec, [c], GREEDY)[0].token_ids for c in (COPY, OTHER, COPY)]
    batched = [o.token_ids for o in chat(spec, [COPY, OTHER, COPY], GREEDY)]
    assert batched == single


def test_seeded_sampling_gives_the_same_tokens_as_without_drafts(plain, spec):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=40, n=2)
    want = plain.chat(COPY, params, use_tqdm=False)[0].outputs
    got = spec.chat(COPY, params, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert want[0].token_ids != want[1].token_ids  # n children really differ


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=40, presence_penalty=0.8, frequency_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=30, logit_bias={"13": -5.0}),
        SamplingParams(temperature=0, max_tokens=40, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=60, stop=["zebras"]),
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[30]),
    ],
    ids=["repetition", "presence+frequency", "min_tokens+bias", "logprobs", "stop", "stop_id"],
)
def test_composes_with_sampling_features(plain, spec, params):
    (want,) = chat(plain, [COPY], params)
    (got,) = chat(spec, [COPY], params)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.finish_reason == want.finish_reason and got.stop_reason == want.stop_reason
    if params.logprobs:
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_stop_string_inside_an_accepted_run_cuts_exactly(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=80, stop=["liquor"])
    (got,) = chat(spec, [COPY], params)
    assert got.text == chat(plain, [COPY], params)[0].text
    assert "liquor" not in got.text and got.finish_reason == "stop"


@pytest.mark.parametrize(
    "guide",
    [
        {"regex": "[A-Za-z ,.!]+"},
        {"choice": [TEXT[:60], "Something else entirely."]},  # completes: a step ends there
        {
            "json": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            }
        },  # fmt: skip
    ],
    ids=["regex", "choice", "json"],
)
def test_grammar_checks_every_draft(plain, spec, guide):
    from tokenmill.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(**guide)
    )
    accepted = hook(spec).stats.num_accepted_tokens
    (want,) = chat(plain, [COPY], params)
    (got,) = chat(spec, [COPY], params)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert hook(spec).stats.num_accepted_tokens > accepted  # drafts ran under the grammar


def test_structured_output_and_disable_spec_decode(plain, spec):
    from tokenmill.sampling_params import StructuredOutputsParams

    guided = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="[A-Z ]+")
    )
    assert chat(spec, [COPY], guided)[0].token_ids == chat(plain, [COPY], guided)[0].token_ids
    off = SamplingParams(temperature=0, max_tokens=40, disable_spec_decode=True)
    drafted = hook(spec).stats.num_draft_tokens
    assert chat(spec, [COPY], off)[0].token_ids == chat(plain, [COPY], off)[0].token_ids
    assert hook(spec).stats.num_draft_tokens == drafted  # nothing drafted for either


def test_prefix_cache_hit_keeps_acceptance(spec):
    spec.reset_prefix_cache()
    stats = hook(spec).stats
    first = (stats.num_draft_tokens, stats.num_accepted_tokens)
    cold = chat(spec, [COPY], GREEDY)[0].token_ids
    mid = (stats.num_draft_tokens, stats.num_accepted_tokens)
    warm = chat(spec, [COPY], GREEDY)[0].token_ids  # the prompt's blocks come from the cache
    last = (stats.num_draft_tokens, stats.num_accepted_tokens)
    assert warm == cold
    assert spec.engine.prefix_cache_metrics()["prefix_cache_hits"] > 0
    assert last[1] - mid[1] >= mid[1] - first[1] - 2  # acceptance did not collapse on a hit


def test_preemption_and_abort_return_every_block(smollm2_gguf, plain):
    want = [o.token_ids for o in chat(plain, [COPY, OTHER, COPY, OTHER], GREEDY)]
    with _llm(smollm2_gguf, METHODS["ngram"], num_kv_blocks=16, block_size=16, max_model_len=256,
              check_kv_integrity=True) as llm:  # fmt: skip
        got = [o.token_ids for o in chat(llm, [COPY, OTHER, COPY, OTHER], GREEDY)]
        assert got == want
        assert llm.engine.scheduler.num_preemptions > 0
        engine = llm.engine
        prompt = llm.tokenizer.apply_chat_template(COPY, add_generation_prompt=True)
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=150))
        for _ in range(8):
            engine.step()
        assert hook(llm).stats.num_drafts > 0
        engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_async_scheduling_gives_the_same_output(smollm2_gguf, plain):
    want = [o.token_ids for o in chat(plain, [COPY, OTHER], GREEDY)]
    with _llm(smollm2_gguf, METHODS["suffix"], async_scheduling="on") as llm:
        assert [o.token_ids for o in chat(llm, [COPY, OTHER], GREEDY)] == want
        s = hook(llm).stats  # drafts ran every step they could (a draft step is drained)
        assert s.num_accepted_tokens >= 10 and s.num_drafts >= 8


def test_adaptive_cap_and_cost_curve(smollm2_gguf, plain):
    spec = {"method": "ngram", "num_speculative_tokens": 6}
    with _llm(smollm2_gguf, spec) as llm:
        h = hook(llm)
        curve = h.length.curve
        assert curve.tokens[0] == 1 and len(curve.tokens) >= 7  # measured at start-up
        assert all(curve.ratio(k) >= 1.0 for k in range(1, 8))
        got = [o.token_ids for o in chat(llm, [COPY, OTHER], GREEDY)]
        assert got == [o.token_ids for o in chat(plain, [COPY, OTHER], GREEDY)]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"speculative_config": {"method": "medusa"}}, "unknown"),
        ({"speculative_config": {"method": "eagle3"}}, "EAGLE-3 head's folder"),
        ({"speculative_config": {"method": "ngram", "model": "x"}}, "takes no 'model'"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_spec"),
        (
            {
                "speculative_config": {
                    "method": "ngram",
                    "prompt_lookup_min": 5,
                    "prompt_lookup_max": 2,
                }
            },
            "prompt_lookup_min",
        ),  # fmt: skip
        ({"speculative_config": {"method": "ngram", "bogus": 1}}, "bogus"),
        ({"speculative_config": {"method": "draft_model"}}, "needs 'model'"),
        (
            {"speculative_config": {"method": "draft_model", "model": "x", "verify_tree_size": 8}},
            "draft trees",
        ),  # fmt: skip
        ({"speculative_config": {"method": "ngram"}, "num_speculative_tokens": 3}, "not both"),
        ({"speculative_config": "ngram"}, "must be a dict"),
        (
            {"speculative_method": "draft_model", "draft_model_id_or_path": "x", "draft_top_k": 2},
            "draft trees",
        ),  # fmt: skip
        ({"draft_top_k": 2}, "set a speculative method"),
    ],
)
def test_bad_configs_are_clear_errors(options, message):
    from tokenmill.config import EngineConfig

    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(**options)


def test_flat_names_and_cli_flag():
    from tokenmill.config import EngineConfig
    from tokenmill.entrypoints.args import json_object

    flat = EngineConfig(speculative_method="[ngram]", num_speculative_tokens=3).speculative
    assert flat is not None and (flat.method, flat.num_speculative_tokens) == ("ngram", 3)
    parsed = json_object('{"method": "suffix", "num_speculative_tokens": 7}')
    spec = EngineConfig(speculative_config=parsed).speculative
    assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("suffix", 7)
    assert EngineConfig().speculative is None


def test_serve_flags_reach_the_engine_config():
    from tokenmill.config import EngineConfig
    from tokenmill.entrypoints.args import engine_options
    from tokenmill.entrypoints.cli import build_parser
    from tokenmill.vllm_compat import check_compat_options

    def config(args) -> EngineConfig:  # what LLM(**options) does with the flags
        opts = engine_options(args)
        check_compat_options(opts)
        opts.pop("generation_config", None)
        return EngineConfig(**opts)

    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 6}']
    )
    spec = config(args).speculative
    assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("suffix", 6)
    flat = config(parser.parse_args(["serve", "--speculative-method", "ngram"])).speculative
    assert flat is not None and flat.method == "ngram"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative-config", "{not json"])


def test_ngram_trees_keep_the_output(smollm2_gguf, plain):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
            "draft_top_k": 2, "verify_tree_size": 8}  # fmt: skip
    want = [o.token_ids for o in chat(plain, [COPY, OTHER], GREEDY)]
    with _llm(smollm2_gguf, spec) as llm:
        assert [o.token_ids for o in chat(llm, [COPY, OTHER], GREEDY)] == want
        assert hook(llm).stats.num_accepted_tokens >= 10
