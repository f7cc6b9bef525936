"""Limits a grammar must pass before the native compiler sees it.

llguidance recurses on the grammar's structure: a chain of a few thousand rules
overflows its native stack (a segfault that takes the whole process down), and
some grammars it accepts fail only once generation starts (a lexer or parser
limit hit on the first token). ``check_grammar`` measures the spec in Python,
without recursion, and raises ``GrammarLimitError`` naming the limit (and the
server flag that sets it) before anything reaches llguidance.

What is measured, per kind:

- every kind: the spec's size in bytes;
- ``grammar`` (Lark/GBNF): rule count, bracket nesting, repetition bounds
  (``x{n,m}``, ``x~n..m`` and the ones inside ``/regex/`` terminals), and whether
  the start rule can derive any finite string at all (``start: "a" start`` can not);
- ``regex`` (and JSON ``pattern``): group nesting and the product of nested
  counted repetitions (``a{1000}{1000}`` is a million);
- ``json``: nesting depth, ``anyOf``/``oneOf``/``enum`` branches, ``$defs`` count,
  and ``$ref`` cycles that can never produce a value;
- ``choice``: the number of choices.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output.params import GrammarSpec


class GrammarLimitError(InvalidRequestError):
    """A grammar over one of the ``GrammarLimits``, or one that can never be satisfied."""


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one request's grammar (server flags ``--max-grammar-*``)."""

    max_bytes: int = 256 * 1024
    """Size of the schema, regex, grammar or choice list, in UTF-8 bytes."""
    max_rules: int = 1000
    """Rules of a Lark/GBNF grammar; ``$defs`` entries of a JSON schema."""
    max_depth: int = 128
    """Nesting of brackets/groups (grammar, regex) or of JSON containers (schema)."""
    max_repeat: int = 100_000
    """Product of nested counted repetitions (``(a{100}){100}`` = 10,000)."""
    max_alternatives: int = 1900
    """Choices, ``anyOf``/``oneOf`` branches, ``enum`` values (llguidance refuses rows
    over 2,000 items only once generation starts)."""
    compile_timeout: float = 30.0
    """Seconds a compile may take before its request is refused."""
    cache_bytes: int = 512 * 1024 * 1024
    """Estimated memory of the compiled grammars kept for reuse (least recently used go)."""
    max_lexer_states: int = 100_000
    """llguidance's lexer states per grammar (about 1-2 kB each): bounds the memory a
    grammar's lexer may grow to during generation."""

    def __post_init__(self) -> None:
        for name in (
            "max_bytes",
            "max_rules",
            "max_depth",
            "max_repeat",
            "max_alternatives",
            "cache_bytes",
            "max_lexer_states",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.compile_timeout <= 0:
            raise ValueError(f"compile_timeout must be > 0 seconds, got {self.compile_timeout}")


_FLAGS = {
    "max_bytes": "--max-grammar-bytes",
    "max_rules": "--max-grammar-rules",
    "max_depth": "--max-grammar-depth",
    "max_repeat": "--max-grammar-repeat",
    "max_alternatives": "--max-grammar-alternatives",
}


def _over(limits: GrammarLimits, name: str, what: str, value: int) -> GrammarLimitError:
    limit = getattr(limits, name)
    return GrammarLimitError(
        f"the guide's {what} is {value}, over the limit of {limit} "
        f"({name}; server flag {_FLAGS[name]})"
    )


def check_grammar(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """Raise ``GrammarLimitError`` if ``spec`` is over a limit or can never be satisfied."""
    size = len(spec.text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise _over(limits, "max_bytes", "size in bytes", size)
    if spec.whitespace_pattern:
        check_regex(spec.whitespace_pattern, limits)
    if spec.kind == "regex":
        check_regex(spec.text, limits)
    elif spec.kind == "grammar":
        check_lark(spec.text, limits)
    elif spec.kind == "choice":
        n = len(json.loads(spec.text))
        if n > limits.max_alternatives:
            raise _over(limits, "max_alternatives", "number of choices", n)
    elif spec.kind in ("json", "structural_tag"):
        check_schema(json.loads(spec.text), limits)


# -- regular expressions -------------------------------------------------------------------
_BOUND = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def check_regex(text: str, limits: GrammarLimits, depth0: int = 0) -> None:
    """Group nesting and the product of nested counted repetitions of a regex."""
    frames = [1]  # per open group: the largest repetition product inside it
    last = 1  # repetition product of the atom before the current position
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            last = 1
            continue
        if c == "[":  # a class: skip to its closing bracket
            i = _class_end(text, i)
            last = 1
            continue
        if c == "(":
            frames.append(1)
            if len(frames) - 1 + depth0 > limits.max_depth:
                raise _over(limits, "max_depth", "regex group nesting", len(frames) - 1 + depth0)
            i += 1
            continue
        if c == ")" and len(frames) > 1:
            last = frames.pop()
            frames[-1] = max(frames[-1], last)
            i += 1
            continue
        if c == "{":
            m = _BOUND.match(text, i)
            if m and (m.group(1) or m.group(2)):
                bound = max(int(m.group(1) or 0), int(m.group(2) or 0))
                last = last * max(bound, 1)
                if last > limits.max_repeat:
                    raise _over(limits, "max_repeat", "nested repetition count", last)
                frames[-1] = max(frames[-1], last)
                i = m.end()
                continue
        last = 1
        i += 1


def _class_end(text: str, i: int) -> int:
    """Index after the ``]`` closing the character class that opens at ``i``."""
    j = i + 1
    if j < len(text) and text[j] == "^":
        j += 1
    if j < len(text) and text[j] == "]":
        j += 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


# -- JSON schemas ----------------------------------------------------------------------------
_BRANCHES = ("anyOf", "oneOf", "allOf", "enum", "prefixItems")


def check_schema(schema, limits: GrammarLimits) -> None:
    """Depth, branches, definitions and patterns of a schema (iterative: any depth is safe)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise _over(limits, "max_depth", "JSON nesting depth", depth)
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        for key in _BRANCHES:
            value = node.get(key)
            if isinstance(value, list) and len(value) > limits.max_alternatives:
                raise _over(limits, "max_alternatives", f"number of {key} entries", len(value))
        for key in ("$defs", "definitions"):
            value = node.get(key)
            if isinstance(value, dict) and len(value) > limits.max_rules:
                raise _over(limits, "max_rules", f"number of {key}", len(value))
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex(pattern, limits)
        stack.extend((v, depth + 1) for v in node.values())
    if isinstance(schema, dict):
        _check_refs(schema)


def _check_refs(schema: dict) -> None:
    """A schema that is only a ``$ref`` chain ending where it started has no value."""
    seen: set[str] = set()
    node, ref = schema, "#"
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and _only_ref(node):
        seen.add(ref)
        ref = node["$ref"]
        if ref in seen:
            raise GrammarLimitError(
                f"the JSON schema can never be satisfied: $ref {ref!r} "
                "refers back to itself (a $ref cycle with no value)"
            )
        node = _resolve(schema, ref)


def _only_ref(node: dict) -> bool:
    return not (
        {"type", "properties", "anyOf", "oneOf", "allOf", "enum", "const", "items"} & node.keys()
    )


def _resolve(root: dict, ref: str):
    """The local subschema ``ref`` (``#/$defs/a``) points to, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


# -- Lark / GBNF -----------------------------------------------------------------------------
_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+|//[^\n]*|\#[^\n]*)
  | (?P<str>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*')
  | (?P<re>/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<cls>\[(?:\^)?\]?(?:[^\]\\]|\\.)*\](?=[^:]))
  | (?P<special><[^<>\s]+>)
  | (?P<directive>%[^\n]*)
  | (?P<def>::=|:)
  | (?P<bound>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<range>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_\-]*(?:\.-?\d+)?)
  | (?P<op>->|[|()\[\]?*+,.])
  | (?P<num>\d+)
""",
    re.VERBOSE,
)


def _tokens(text: str) -> list[tuple[str, str]] | None:
    """(kind, text) pairs, whitespace dropped; None for text this scanner does not know."""
    out = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            return None
        pos = m.end()
        kind = m.lastgroup or ""
        if kind not in ("ws", "directive"):
            out.append((kind, m.group()))
    return out


def check_lark(text: str, limits: GrammarLimits) -> None:
    """Rules, nesting and repetitions of a Lark/GBNF grammar, and that ``start`` (or
    ``root``) can derive a finite string. Text the scanner does not understand is left
    to llguidance after the size-only checks (rules are then counted by line)."""
    toks = _tokens(text)
    if toks is None:
        rules = sum(1 for line in text.splitlines() if re.match(r"\s*[?!]?\w+\s*(::=|:)", line))
        if rules > limits.max_rules:
            raise _over(limits, "max_rules", "number of rules", rules)
        _check_brackets(text, limits)
        return
    rules = _split_rules(toks)
    if len(rules) > limits.max_rules:
        raise _over(limits, "max_rules", "number of rules", len(rules))
    depth = 0
    for kind, tok in toks:
        if kind == "re":
            check_regex(tok[1 : tok.rindex("/")], limits, depth)
        elif tok in ("(", "["):
            depth += 1
            if depth > limits.max_depth:
                raise _over(limits, "max_depth", "bracket nesting", depth)
        elif tok in (")", "]"):
            depth = max(depth - 1, 0)
    _check_repeats(toks, limits)
    start = "root" if "root" in rules and "start" not in rules else "start"
    if start in rules and not _Productive(rules).of(start):
        raise GrammarLimitError(
            f"the grammar can never be satisfied: rule {start!r} derives no finite string "
            "(every alternative needs itself or another rule without an end)"
        )


def _check_brackets(text: str, limits: GrammarLimits) -> None:
    depth = 0
    for c in text:
        if c in "([{":
            depth += 1
            if depth > limits.max_depth:
                raise _over(limits, "max_depth", "bracket nesting", depth)
        elif c in ")]}":
            depth = max(depth - 1, 0)


def _split_rules(toks: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Rule (or terminal) name -> its body tokens; a name followed by ``:`` starts one."""
    rules: dict[str, list[tuple[str, str]]] = {}
    body: list[tuple[str, str]] | None = None
    for i, (kind, tok) in enumerate(toks):
        if kind == "name" and i + 1 < len(toks) and toks[i + 1][0] == "def":
            body = rules.setdefault(_base(tok), [])
            if body:  # several definitions of a name are alternatives
                body.append(("op", "|"))
            continue
        if kind == "def":
            continue
        if body is not None:
            body.append((kind, tok))
    return rules


def _base(name: str) -> str:
    return name.lstrip("?!").split(".")[0]


def _repeat_bound(kind: str, tok: str) -> tuple[int, int] | None:
    """(min, max) of a ``{n,m}`` or ``~n..m`` quantifier token."""
    nums = [int(x) for x in re.findall(r"\d+", tok)]
    if kind == "bound":
        lo = nums[0] if nums else 0
        if "," not in tok:
            return lo, lo
        hi = nums[1] if len(nums) > 1 else lo
        if tok.replace(" ", "").startswith("{,"):
            lo, hi = 0, nums[0] if nums else 0
        return lo, hi
    if kind == "range":
        return nums[0], nums[-1]
    return None


def _check_repeats(toks: list[tuple[str, str]], limits: GrammarLimits) -> None:
    """Products of quantifiers nested through brackets (within one rule)."""
    frames = [1]
    last = 1
    for kind, tok in toks:
        if tok in ("(", "["):
            frames.append(1)
        elif tok in (")", "]") and len(frames) > 1:
            last = frames.pop()
            frames[-1] = max(frames[-1], last)
            continue
        elif kind in ("bound", "range"):
            bound = _repeat_bound(kind, tok)
            last = last * max(bound[1] if bound else 1, 1)
            if last > limits.max_repeat:
                raise _over(limits, "max_repeat", "nested repetition count", last)
            frames[-1] = max(frames[-1], last)
            continue
        elif kind == "def":
            frames = [1]
        last = 1


_SOLVE_BUDGET = 2_000_000


class _Productive:
    """Which rules derive a finite string: a least fixed point over the rules' bodies.

    A name this grammar does not define (an import, a built-in) counts as productive,
    and so does anything the mini-parser does not understand: only a grammar that
    certainly derives nothing is refused."""

    def __init__(self, rules: dict[str, list[tuple[str, str]]]) -> None:
        self.rules = rules
        self.known: set[str] = set()
        self._solve()

    def of(self, name: str) -> bool:
        return name in self.known or name not in self.rules

    def _solve(self) -> None:
        users: dict[str, set[str]] = {}
        for name, body in self.rules.items():
            for kind, tok in body:
                if kind == "name":
                    users.setdefault(_base(tok), set()).add(name)
        queue = list(self.rules)
        queued = set(queue)
        budget = _SOLVE_BUDGET  # tokens read; past it, give up (llguidance decides)
        while queue:
            name = queue.pop()
            queued.discard(name)
            body = self.rules[name]
            budget -= len(body)
            if budget < 0:
                self.known.update(self.rules)
                return
            if name not in self.known and self._body(body):
                self.known.add(name)
                for user in users.get(name, ()):
                    if user not in self.known and user not in queued:
                        queue.append(user)
                        queued.add(user)

    def _body(self, toks: list[tuple[str, str]]) -> bool:
        try:
            value, end = self._alts(toks, 0)
        except (IndexError, ValueError):
            return True
        return value if end >= len(toks) else True

    def _alts(self, toks, i):
        """expr := seq ('|' seq)*; returns (productive, next index)."""
        any_ok = False
        while True:
            ok, i = self._seq(toks, i)
            any_ok = any_ok or ok
            if i < len(toks) and toks[i][1] == "|":
                i += 1
                continue
            return any_ok, i

    def _seq(self, toks, i):
        all_ok = True
        while i < len(toks) and toks[i][1] not in ("|", ")", "]"):
            ok, i = self._item(toks, i)
            all_ok = all_ok and ok
        return all_ok, i

    def _item(self, toks, i):
        kind, tok = toks[i]
        optional = False
        if tok in ("(", "["):
            ok, i = self._alts(toks, i + 1)
            if i >= len(toks) or toks[i][1] not in (")", "]"):
                raise ValueError("unbalanced")
            optional = tok == "["
            i += 1
        elif kind == "name":
            ok = self.of(_base(tok))
            i += 1
        elif tok == "->":  # an alias: skip it and its name
            return True, i + 2
        else:  # literals, classes, special tokens, numbers, separators
            ok = True
            i += 1
        while i < len(toks) and (toks[i][1] in ("?", "*", "+") or toks[i][0] in ("bound", "range")):
            kind, tok = toks[i]
            bound = _repeat_bound(kind, tok)
            if tok in ("?", "*") or (bound is not None and bound[0] == 0):
                optional = True
            i += 1
        return ok or optional, i
