"""The llguidance backend (the default): JSON schema, regex, Lark/GBNF, choice, structural tags.

llguidance builds its lexer over the tokenizer's token trie when a matcher is
created (``compile``); after that a mask costs tens of microseconds, and fresh
matchers are deep copies of the compiled one.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Sequence

import llguidance
import llguidance.hf
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output.backend import (
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
)
from tokenmill.structured_output.limits import GrammarLimitError, GrammarLimits
from tokenmill.structured_output.params import (
    DEFAULT_JSON_WHITESPACE,
    GrammarSpec,
    grammar_format,
)


class GuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.ll = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self.ll.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def accept_token(self, token_id: int) -> bool:
        if self.ll.is_stopped():  # only EOS is left; nothing to advance
            return True
        return self.ll.consume_token(token_id)

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        if self.ll.is_stopped():
            return 0
        return self.ll.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.ll.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.ll.is_stopped()

    def is_accepting(self) -> bool:
        return self.ll.is_accepting()


class GuidanceGrammar(CompiledGrammar):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._template = matcher  # never advanced: copies start from the beginning

    def matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._template.deep_copy())


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(
        self,
        hf_tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        limits: GrammarLimits | None = None,
    ) -> None:
        if getattr(hf_tokenizer, "backend_tokenizer", None) is None:
            raise InvalidRequestError(
                "structured output needs a fast tokenizer (tokenizer.json); this model's "
                f"{type(hf_tokenizer).__name__} is not one"
            )
        self._hf = hf_tokenizer
        self._n_vocab = max(vocab_size, len(hf_tokenizer))
        self._eos = list(eos_token_ids) or None
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._special = _special_tokens(hf_tokenizer)
        self._executor = llguidance.LLExecutor()
        limits = limits or GrammarLimits()
        # Rows over max_items_in_row fail only at generation time; max_alternatives keeps
        # requests below it. Short errors: verbose ones echo the whole grammar.
        self._limits = llguidance.LLParserLimits(
            max_items_in_row=max(2000, limits.max_alternatives + 64),
            max_lexer_states=limits.max_lexer_states,
            verbose_errors=False,
        )

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on the first compile (about a second: it walks the whole vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self._n_vocab, eos_token=self._eos
                )
            return self._ll_tokenizer

    @property
    def bitmask_width(self) -> int:
        return (self._n_vocab + 31) // 32

    def validate(self, spec: GrammarSpec) -> None:
        error = llguidance.LLMatcher.validate_grammar(self._grammar(spec), limits=self._limits)
        if error:
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {error}")

    def compile(self, spec: GrammarSpec) -> GuidanceGrammar:
        matcher = llguidance.LLMatcher(
            self.ll_tokenizer, self._grammar(spec), log_level=0, limits=self._limits
        )
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {matcher.get_error()}")
        self._probe(spec, matcher)
        return GuidanceGrammar(matcher)

    def _probe(self, spec: GrammarSpec, matcher: llguidance.LLMatcher) -> None:
        """Take the first step on a copy: a grammar that allows nothing at all ($ref
        cycles llguidance resolves to nothing), or that trips a lexer or parser limit on
        its first token, is refused now rather than failing mid-generation."""
        probe = matcher.deep_copy()
        mask = probe.compute_bitmask()
        if probe.is_error() or (probe.is_stopped() and not probe.is_accepting()):
            raise GrammarLimitError(
                f"the {_WHAT[spec.kind]} can never be satisfied{_reason(probe)}"
            )
        token = _first_allowed(mask, set(self._eos or ()))
        if token is not None and not probe.consume_token(token):
            raise GrammarLimitError(
                f"the {_WHAT[spec.kind]} is too complex to generate: {_short(probe.get_error())}"
            )

    def fill_bitmasks(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor
    ) -> None:
        """All rows in parallel (llguidance's thread pool, without the GIL)."""
        pairs = [(m.ll, row) for m, row in matchers]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )

    # -- spec -> llguidance grammar ------------------------------------------------------
    def _grammar(self, spec: GrammarSpec) -> str:
        try:
            return _BUILDERS[spec.kind](self, spec)
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {e}") from e

    def _json(self, spec: GrammarSpec) -> str:
        return llguidance.LLMatcher.grammar_from_json_schema(
            _schema(spec, json.loads(spec.text)), defaults=_json_options(spec)
        )

    def _regex(self, spec: GrammarSpec) -> str:
        return llguidance.LLMatcher.grammar_from_regex(spec.text)

    def _lark(self, spec: GrammarSpec) -> str:
        return llguidance.grammar_from(grammar_format(spec.text), spec.text)

    def _choice(self, spec: GrammarSpec) -> str:
        choices = json.loads(spec.text)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        )

    def _structural_tag(self, spec: GrammarSpec) -> str:
        tag = json.loads(spec.text)
        triggers = tag.get("triggers")
        structures = tag.get("structures")
        if not isinstance(triggers, list) or not triggers or not isinstance(structures, list):
            raise ValueError(
                'a structural tag needs "triggers" (a non-empty list) and '
                '"structures" (a list of {"begin", "schema", "end"})'
            )
        tags = []
        for i, s in enumerate(structures):
            begin = s.get("begin", "")
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise ValueError(
                    f"structures[{i}].begin {begin!r} starts with none of the triggers {triggers}"
                )
            tags.append(
                llguidance.StructTag(
                    trigger=trigger,
                    begin=begin,
                    grammar=_schema(spec, s.get("schema", {})),
                    end=s.get("end", ""),
                )
            )
        if not tags:
            raise ValueError("a structural tag needs at least one structure")
        special = all(t in self._special for t in triggers if t.startswith("<"))
        return llguidance.StructTag.to_grammar(tags, assume_special=special)


_BUILDERS = {
    "json": GuidanceBackend._json,
    "json_object": GuidanceBackend._json,
    "regex": GuidanceBackend._regex,
    "grammar": GuidanceBackend._lark,
    "choice": GuidanceBackend._choice,
    "structural_tag": GuidanceBackend._structural_tag,
}
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
    "structural_tag": "structural tag",
}


def _reason(matcher: llguidance.LLMatcher) -> str:
    error = _short(matcher.get_error())
    return f" ({error})" if error else " (it allows no output)"


def _short(error: str) -> str:
    """The first line of an llguidance error (it may append its state dump)."""
    return error.split("\n", 1)[0][:300]


def _first_allowed(mask: bytes, skip: set[int]) -> int | None:
    """The lowest token id set in an llguidance bitmask (little-endian bits), not in skip."""
    for i, byte in enumerate(mask):
        while byte:
            bit = (byte & -byte).bit_length() - 1
            token = i * 8 + bit
            if token not in skip:
                return token
            byte &= byte - 1
    return None


def _json_options(spec: GrammarSpec) -> dict:
    options: dict = {"whitespace_flexible": spec.any_whitespace}
    if spec.any_whitespace or spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern or DEFAULT_JSON_WHITESPACE
    return options


def _schema(spec: GrammarSpec, schema):
    if spec.additional_properties or not isinstance(schema, dict):
        return schema
    schema = copy.deepcopy(schema)
    _close_objects(schema)
    return schema


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "prefixItems",
    "allOf",
    "anyOf",
    "oneOf",
)


def _close_objects(node) -> None:
    """additionalProperties=false wherever an object schema lists properties and leaves it open."""
    if isinstance(node, list):
        for item in node:
            _close_objects(item)
        return
    if not isinstance(node, dict):
        return
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                _close_objects(sub)
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), (dict, list)):
            _close_objects(node[key])
    if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        node["additionalProperties"] = False


def _special_tokens(hf_tokenizer) -> set[str]:
    """Tokens llguidance treats as special: flagged so, or added ones shaped like ``<...>``
    (Qwen's ``<tool_call>``). A grammar names them as ``<tool_call>``, not as text."""
    decoder = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
    return {
        t.content
        for t in decoder.values()
        if getattr(t, "special", False) or (t.content.startswith("<") and t.content.endswith(">"))
    }
