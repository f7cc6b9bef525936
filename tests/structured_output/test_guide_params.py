"""StructuredOutputsParams and its SamplingParams field: exactly one mode, clear errors."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams
from tokenmill.structured_output import StructuredOutputsParams


def test_one_mode_gives_its_spec():
    spec = StructuredOutputsParams(json={"type": "object", "b": 1, "a": 2}).spec()
    assert spec.kind == "json" and spec.text == '{"type":"object","b":1,"a":2}'  # order kept
    same = StructuredOutputsParams(json='{"type": "object",  "b": 1, "a": 2}').spec()
    assert same == spec  # compact JSON: one cache entry
    assert StructuredOutputsParams(choice=["yes", "no"]).spec().text == '["yes", "no"]'
    assert StructuredOutputsParams(json_object=True).spec().kind == "json_object"
    assert StructuredOutputsParams(regex=r"\d+").spec().text == r"\d+"


def test_empty_guide_means_not_requested():
    assert SamplingParams(structured_outputs=StructuredOutputsParams()).structured_outputs is None
    assert (
        SamplingParams(
            structured_outputs=StructuredOutputsParams(json_object=False)
        ).structured_outputs
        is None
    )
    assert SamplingParams(structured_outputs={}).structured_outputs is None


def test_dict_is_accepted_on_sampling_params():
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    assert params.clone().structured_outputs == params.structured_outputs


def test_pydantic_model_class_is_a_schema():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    spec = StructuredOutputsParams(json=Point).spec()
    assert '"required":["x","y"]' in spec.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(json={"type": "object"}, regex="a"), "json and regex"),
        (dict(choice=["a"], grammar="start: 'a'"), "choice and grammar"),
        (dict(choice="ab"), "list of strings"),
        (dict(choice=[]), "empty"),
        (dict(choice=["a", 1]), "strings"),
        (dict(regex=5), "regex must be a str"),
        (dict(regex=""), "empty string"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json=[1, 2]), "JSON schema"),
        (dict(json_object="yes"), "true or false"),
    ],
)
def test_bad_guides_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs).spec()


def test_unknown_field_in_a_dict_guide():
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"jsonn": {}})
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
