"""``StructuredOutputsParams``: what a request's output must look like (vLLM's names).

Exactly one mode per request: ``json`` (a JSON schema), ``json_object`` (any JSON
object), ``regex``, ``choice``, ``grammar`` (Lark, or GBNF/EBNF) or
``structural_tag``. A guide with no mode set means "not requested" (the
``SamplingParams`` field is then normalized to None). Checks here are structural
(types, exactly one mode, the schema is JSON); whether the regex or grammar is valid is
checked by the backend when the request is added (``StructuredOutputManager.validate``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

from tokenmill.errors import InvalidRequestError

MODES = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

DEFAULT_JSON_WHITESPACE = r"[\x20\x09]{1,4}|\x0D?\x0A[\x20\x09]{0,32}"
"""Whitespace allowed between two JSON tokens: a few spaces, or one line break and an
indentation. Bounded, so that a small model can not loop on whitespace forever."""


_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=", re.MULTILINE)


def grammar_format(text: str) -> str:
    """The grammar's syntax: "gbnf" when a line defines a rule with ``::=`` (the test vLLM
    uses), else "lark" (a Lark grammar may start with ``?start:``)."""
    return "gbnf" if _GBNF_RULE.search(text) else "lark"


@dataclass(frozen=True)
class GrammarSpec:
    """A normalized, hashable constraint: the compile cache key."""

    kind: str
    """One of MODES."""
    text: str
    """The schema as compact JSON (key order kept), the regex, the grammar, the choices as
    a JSON list, or the structural tag as canonical JSON."""
    any_whitespace: bool = True
    """JSON modes: allow any whitespace between tokens (False: compact JSON only)."""
    additional_properties: bool = False
    """JSON modes: False sets additionalProperties=false where a schema lists properties and
    leaves it unset (vLLM's default); True reads an unset one as JSON Schema does (open)."""
    whitespace_pattern: str | None = None
    """JSON modes: the regex whitespace between tokens must match (overrides the above)."""


@dataclass
class StructuredOutputsParams:
    """Constrain the output with a grammar; set exactly one mode (vLLM-compatible)."""

    json: str | dict | None = None
    """A JSON schema (a dict, or its JSON text): the output is one JSON value valid under it."""
    regex: str | None = None
    """The output fully matches this regular expression (Rust ``regex`` syntax)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar in Lark syntax (llguidance's dialect) or GBNF/EBNF."""
    json_object: bool | None = None
    """True: the output is any JSON object."""
    structural_tag: str | dict | None = None
    """Free text in which tagged segments follow a schema: ``{"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}`` (a dict, or its JSON text)."""
    disable_any_whitespace: bool = False
    """JSON modes: generate compact JSON (no whitespace between tokens)."""
    disable_additional_properties: bool = False
    """vLLM's name; objects are closed by default now (see ``allow_additional_properties``):
    True keeps them closed even with ``allow_additional_properties``."""
    allow_additional_properties: bool = False
    """JSON modes: an object schema that lists properties and does not set
    ``additionalProperties`` allows extra keys (JSON Schema's own reading). By default
    such objects are closed to their listed properties, as vLLM does, so a model can not
    add keys until max_tokens; a schema that sets ``additionalProperties`` is kept as is."""
    whitespace_pattern: str | None = None
    """JSON modes: a regex for the whitespace allowed between JSON tokens (default:
    ``DEFAULT_JSON_WHITESPACE``, one line break at most)."""
    disable_fallback: bool = False
    """Accepted for vLLM compatibility; tokenmill never falls back to another backend."""

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            self.json = _schema_of(self.json)
        _type("regex", self.regex, str)
        _type("grammar", self.grammar, str)
        _type("whitespace_pattern", self.whitespace_pattern, str)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise InvalidRequestError(
                f"structured_outputs.json_object must be true or false, got {self.json_object!r}"
            )
        if self.choice is not None:
            self.choice = _choices(self.choice)
        set_modes = self.modes()
        if len(set_modes) > 1:
            raise InvalidRequestError(
                f"structured_outputs sets {' and '.join(set_modes)}; set exactly one of "
                f"{', '.join(MODES)}"
            )
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise InvalidRequestError(f"structured_outputs.{name} is an empty string")

    def modes(self) -> list[str]:
        """The modes that are set (an empty guide: none; a valid one: exactly one)."""
        return [m for m in MODES if getattr(self, m) not in (None, False)]

    @property
    def is_empty(self) -> bool:
        return not self.modes()

    def spec(self) -> GrammarSpec:
        """The normalized constraint; raises InvalidRequestError on a malformed JSON guide."""
        (kind,) = self.modes()
        value = getattr(self, kind)
        if kind == "json":
            text = _canonical_json("json", value)
        elif kind == "json_object":
            text = '{"type":"object"}'
        elif kind == "choice":
            text = json.dumps(value, ensure_ascii=False)
        elif kind == "structural_tag":
            text = _canonical_json("structural_tag", value)
        else:
            text = value
        open_objects = self.allow_additional_properties and not self.disable_additional_properties
        return GrammarSpec(
            kind, text, not self.disable_any_whitespace, open_objects, self.whitespace_pattern
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """From a JSON body (the server's ``structured_outputs`` field)."""
        if not isinstance(data, dict):
            raise InvalidRequestError(
                f"structured_outputs must be an object, got {type(data).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(
                f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}"
            )
        return cls(**data)


def _type(name: str, value: Any, kind: type) -> None:
    if value is not None and not isinstance(value, kind):
        raise InvalidRequestError(
            f"structured_outputs.{name} must be a {kind.__name__}, got {type(value).__name__}"
        )


def _choices(value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise InvalidRequestError(
            f"structured_outputs.choice must be a list of strings, got {value!r}"
        )
    if not value:
        raise InvalidRequestError("structured_outputs.choice is empty; list at least one string")
    bad = [c for c in value if not isinstance(c, str)]
    if bad:
        raise InvalidRequestError(f"structured_outputs.choice must hold strings, got {bad[0]!r}")
    return list(value)


def _schema_of(value: Any) -> dict:
    """A pydantic model class is accepted as a schema (vLLM accepts it too)."""
    schema = getattr(value, "model_json_schema", None)
    if callable(schema):
        return schema()
    raise InvalidRequestError(
        f"structured_outputs.json must be a JSON schema (dict or JSON text), got "
        f"{type(value).__name__}"
    )


def _canonical_json(name: str, value: str | dict) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"structured_outputs.{name} is not valid JSON: {e}") from e
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError(
            f"structured_outputs.{name} must be a JSON object, got {type(value).__name__}"
        )
    # Key order is kept: it is the order the properties are generated in.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
