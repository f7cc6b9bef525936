"""Guided decoding with the real SmolLM2 (the default model): every finished output
satisfies its constraint, in one batched generate call per test."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from structured_cases import CHOICES, REGEXES, SCHEMAS

from tokenmill import LLM, SamplingParams
from tokenmill.structured_output import StructuredOutputsParams as Guide


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    llm = LLM(dtype="float32", max_model_len=1024)
    yield llm
    llm.close()


def _chat(llm: LLM, text: str) -> dict:
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return {"prompt_token_ids": ids}


def _params(guide: Guide, **kwargs) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0, "max_tokens": 80, **kwargs}, structured_outputs=guide
    )


def test_json_schemas_regexes_and_choices_are_always_valid(smol):
    prompts, params, checks = [], [], []
    for what, schema in SCHEMAS:
        prompts.append(_chat(smol, f"Give me {what} as JSON."))
        params.append(_params(Guide(json=schema)))
        checks.append(lambda text, s=schema: jsonschema.validate(json.loads(text), s))
    for what, regex in REGEXES:
        prompts.append(_chat(smol, f"Write {what}."))
        params.append(_params(Guide(regex=regex)))
        checks.append(lambda text, r=regex: _assert(re.fullmatch(r, text), text))
    for question, choices in CHOICES:
        prompts.append(_chat(smol, question))
        params.append(_params(Guide(choice=choices)))
        checks.append(lambda text, c=choices: _assert(text in c, text))
    prompts.append(_chat(smol, "Return a JSON object with the keys city and country for Paris."))
    params.append(_params(Guide(json_object=True)))
    checks.append(lambda text: _assert(isinstance(json.loads(text), dict), text))
    outs = smol.generate(prompts, params)
    assert len(outs) >= 35
    for out, check in zip(outs, checks):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (comp.finish_reason, comp.text)
        check(comp.text)


def test_sampled_outputs_are_valid_too(smol):
    schema = SCHEMAS[0][1]
    params = [_params(Guide(json=schema), temperature=1.0, seed=i) for i in range(6)]
    outs = smol.generate([_chat(smol, "Invent a person as JSON.")] * 6, params)
    for out in outs:
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        jsonschema.validate(json.loads(comp.text), schema)


def test_grammar_and_compact_json(smol):
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    gbnf = 'root ::= ("cat" | "dog") " says " ("hi" | "bye")'
    compact = Guide(json=SCHEMAS[1][1], disable_any_whitespace=True)
    outs = smol.generate(
        [
            _chat(smol, "What is 6 times 7?"),
            _chat(smol, "Pick an animal."),
            _chat(smol, "Name a city as JSON."),
        ],
        [_params(Guide(grammar=lark)), _params(Guide(grammar=gbnf)), _params(compact)],
    )
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", outs[0].outputs[0].text)
    assert re.fullmatch(r"(cat|dog) says (hi|bye)", outs[1].outputs[0].text)
    text = outs[2].outputs[0].text
    assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


def test_max_tokens_cuts_with_length(smol):
    out = smol.generate(
        _chat(smol, "A person as JSON."), _params(Guide(json=SCHEMAS[0][1]), max_tokens=3)
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_n_children_each_follow_the_grammar(smol):
    params = _params(Guide(choice=["alpha", "beta", "gamma"]), n=3, temperature=1.0, seed=3)
    out = smol.generate(_chat(smol, "Pick one."), params)[0]
    assert [c.text in ("alpha", "beta", "gamma") for c in out.outputs] == [True] * 3


@pytest.mark.parametrize(
    "guide, message",
    [
        (Guide(json={"type": "object", "properties": {"a": {"type": "strng"}}}), "JSON schema"),
        (Guide(regex="(unclosed"), "regex"),
        (Guide(grammar="start: undefined_rule"), "grammar"),
    ],
)
def test_invalid_guides_are_value_errors_naming_the_problem(smol, guide, message):
    with pytest.raises(ValueError, match=message):
        smol.generate("hi", SamplingParams(structured_outputs=guide))
    assert not smol.engine.has_unfinished()


def _assert(ok, text: str) -> None:
    assert ok, text
