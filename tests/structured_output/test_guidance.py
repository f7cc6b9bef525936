"""The llguidance backend on SmolLM2's tokenizer: errors, masks, completion, rollback,
structural tags, special tokens, and the whitespace bound."""

from __future__ import annotations

import pytest
import torch

from tokenmill.structured_output import StructuredOutputsParams as Guide
from tokenmill.structured_output.bitmask import allocate_bitmask, unpack_bitmask
from tokenmill.structured_output.guidance import GuidanceBackend

EOS = 2


@pytest.fixture(scope="module")
def backend(smollm2_hf_tokenizer):
    return GuidanceBackend(smollm2_hf_tokenizer, len(smollm2_hf_tokenizer), [EOS])


@pytest.fixture(scope="module")
def encode(smollm2_hf_tokenizer):
    return lambda text: smollm2_hf_tokenizer.encode(text, add_special_tokens=False)


def _allowed(backend, matcher) -> set[int]:
    bitmask = allocate_bitmask(1, backend.bitmask_width)
    matcher.fill_bitmask(bitmask, 0)
    return set(unpack_bitmask(bitmask, backend.bitmask_width * 32)[0].nonzero().flatten().tolist())


def _matcher(backend, **guide):
    return backend.compile(Guide(**guide).spec()).matcher()


def test_json_stops_after_the_closing_brace(backend, encode):
    m = _matcher(
        backend,
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    )
    assert EOS not in _allowed(backend, m)
    for t in encode('{"a": 12}'):
        assert m.accept_token(t) and EOS not in _allowed(backend, m) or m.is_terminated()
    assert m.is_terminated() and m.is_accepting() and _allowed(backend, m) == {EOS}


def test_eos_only_where_the_regex_accepts(backend, encode):
    m = _matcher(backend, regex=r"[0-9]{2,4}")
    [one] = encode("7")
    assert m.accept_token(one) and EOS not in _allowed(backend, m)
    assert m.accept_token(one) and EOS in _allowed(backend, m) and not m.is_terminated()
    assert not m.accept_token(encode("x")[0])


def test_rollback_undoes_tokens(backend, encode):
    m = _matcher(backend, choice=["alpha", "beta"])
    before = _allowed(backend, m)
    ids = encode("alpha")
    for t in ids:
        assert m.accept_token(t)
    assert m.is_terminated()
    m.rollback(len(ids))
    assert not m.is_terminated() and _allowed(backend, m) == before


def test_matchers_of_one_grammar_are_independent(backend, encode):
    grammar = backend.compile(Guide(choice=["yes", "no"]).spec())
    a, b = grammar.matcher(), grammar.matcher()
    for t in encode("yes"):
        assert a.accept_token(t)
    assert a.is_terminated() and not b.is_terminated()


def test_whitespace_between_json_tokens_is_bounded(backend, encode):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for text, ok in (
        ('{\n    "a": 1\n}', True),
        ('{"a":  1}', True),
        ('{\n\n\n"a": 1}', False),
        ("{" + " " * 12 + '"a": 1}', False),
    ):
        m = _matcher(backend, json=schema)
        assert all(m.accept_token(t) for t in encode(text)) is ok, text
    compact = _matcher(backend, json=schema, disable_any_whitespace=True)
    assert not all(compact.accept_token(t) for t in encode('{"a": 1}'))


def test_objects_are_closed_unless_the_schema_or_the_option_opens_them(backend, encode):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    extra = '{"a": 1, "b": 2}'
    for guide, accepted in (
        ({}, False),
        ({"disable_additional_properties": True}, False),
        ({"allow_additional_properties": True}, True),
    ):
        m = _matcher(backend, json=schema, **guide)
        assert all(m.accept_token(t) for t in encode(extra)) is accepted, guide
    stated = _matcher(backend, json={**schema, "additionalProperties": True})
    assert all(stated.accept_token(t) for t in encode(extra))
    nested = _matcher(backend, json={"type": "object", "properties": {"o": schema}})
    assert not all(nested.accept_token(t) for t in encode('{"o": {"a": 1, "b": 2}}'))


@pytest.mark.parametrize(
    "grammar,text",
    [
        ('?start: pair\npair: WORD "=" WORD\nWORD: /[a-z]+/', "ab=cd"),  # Lark, vLLM's style
        ('root ::= "yes" | "no"', "no"),  # GBNF
        ('start: "x"+  // a comment with ::= in it', "xxx"),
    ],
)
def test_grammar_syntax_is_detected(backend, encode, grammar, text):
    m = _matcher(backend, grammar=grammar)
    assert all(m.accept_token(t) for t in encode(text)) and m.is_accepting()


def test_structural_tag_constrains_only_the_tagged_part(backend, encode):
    tag = {
        "structures": [
            {
                "begin": "<f=add>",
                "end": "</f>",
                "schema": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                    "additionalProperties": False,
                },
            }
        ],
        "triggers": ["<f="],
    }
    good = _matcher(backend, structural_tag=tag)
    assert all(good.accept_token(t) for t in encode('Sure. <f=add>{"a": 3}</f> done'))
    bad = _matcher(backend, structural_tag=tag)
    assert not all(bad.accept_token(t) for t in encode('Sure. <f=add>{"b": 3}'))


@pytest.mark.parametrize(
    "guide, words",
    [
        (Guide(regex="(a"), "invalid regex"),
        (Guide(grammar="start: nope"), "invalid grammar"),
        (
            Guide(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
            "invalid JSON schema",
        ),
        (
            Guide(structural_tag={"structures": [{"begin": "<x>"}], "triggers": ["<y"]}),
            "starts with none of the triggers",
        ),
        (Guide(structural_tag={"structures": []}), "triggers"),
    ],
)
def test_validation_names_the_problem(backend, guide, words):
    with pytest.raises(ValueError, match=words):
        backend.validate(guide.spec())


def test_mask_rows_fill_in_parallel(backend):
    grammars = [backend.compile(Guide(choice=[w]).spec()).matcher() for w in ("cat", "dog")]
    bitmask = allocate_bitmask(2, backend.bitmask_width)
    backend.fill_bitmasks([(grammars[0], 0), (grammars[1], 1)], bitmask)
    one = allocate_bitmask(1, backend.bitmask_width)
    grammars[1].fill_bitmask(one, 0)
    assert torch.equal(bitmask[1], one[0]) and not torch.equal(bitmask[0], bitmask[1])
