"""Grammar limits (checked in Python before llguidance sees a grammar), the big-stack
compile threads, the first-step probe, the compile timeout and the byte-bounded cache."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future

import pytest

from tokenmill.structured_output import StructuredOutputsParams as Guide
from tokenmill.structured_output.compile_cache import GrammarCache, resident_bytes
from tokenmill.structured_output.limits import GrammarLimitError, GrammarLimits, check_grammar
from tokenmill.structured_output.manager import StructuredOutputManager

LIMITS = GrammarLimits()


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "guide, limit",
    [
        (
            dict(
                grammar="start: r0\n"
                + "".join(f'r{i}: "t" | r{i + 1}\n' for i in range(1500))
                + 'r1500: "e"'
            ),
            "max_rules",
        ),
        (dict(regex="x" * 300_000), "max_bytes"),
        (dict(regex="a{1000}{1000}"), "max_repeat"),
        (dict(regex="((a{100}){100}){100}"), "max_repeat"),
        (dict(regex="(" * 200 + "a" + ")" * 200), "max_depth"),
        (dict(grammar='start: ("a"{1000}){1000}'), "max_repeat"),
        (dict(grammar="start: /(b{500}){500}/"), "max_repeat"),
        (dict(json={"type": "string", "pattern": "(c{999}){999}"}), "max_repeat"),
        (dict(json=_nested(100)), "max_depth"),
        (dict(json={"anyOf": [{"const": i} for i in range(2500)]}), "max_alternatives"),
        (dict(json={"enum": list(range(2500))}), "max_alternatives"),
        (dict(json={"$defs": {f"d{i}": {"type": "integer"} for i in range(1200)}}), "max_rules"),
        (dict(choice=[f"c{i}" for i in range(2500)]), "max_alternatives"),
    ],
)
def test_over_a_limit_names_it(guide, limit):
    with pytest.raises(GrammarLimitError, match=limit):
        check_grammar(Guide(**guide).spec(), LIMITS)


@pytest.mark.parametrize(
    "guide",
    [
        dict(grammar='start: "a" start'),
        dict(grammar="root ::= root"),
        dict(grammar='root ::= "a" root'),
        dict(grammar='start: a\na: "x" b\nb: "y" a'),
        dict(json={"$ref": "#"}),
        dict(
            json={
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            }
        ),
    ],
)
def test_unsatisfiable_grammars_are_refused(guide):
    with pytest.raises(GrammarLimitError, match="can never be satisfied"):
        check_grammar(Guide(**guide).spec(), LIMITS)


@pytest.mark.parametrize(
    "guide",
    [
        dict(grammar='start: "x" ("y" | "z")'),
        dict(grammar='start: expr\nexpr: NUM | "(" expr ")" | expr "+" expr\nNUM: /[0-9]+/'),
        dict(grammar='root ::= "a" root | "b"'),
        dict(grammar='start: "a" [start]'),
        dict(grammar='start: ("a" start)* "b"'),
        dict(grammar='start: "a"{0,3} start{0,1}'),
        dict(grammar='start: item+\nitem: "k" | "v"'),
        dict(regex=r"[0-9]{3}-[a-z]{2}\{5\}"),
        dict(regex="(a{300}){300}"),
        dict(
            json={
                "type": "object",
                "properties": {"n": {"$ref": "#/$defs/node"}},
                "$defs": {
                    "node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}
                },
            }
        ),
        dict(choice=["red", "green"]),
    ],
)
def test_ordinary_grammars_pass(guide):
    check_grammar(Guide(**guide).spec(), LIMITS)


def test_the_checks_are_fast_on_the_largest_allowed_inputs():
    big = dict(
        grammar="start: "
        + " | ".join(f'"w{i}"' for i in range(1800))
        + "\n"
        + "".join(f"r{i}: r{i + 1}\n" for i in range(990))
        + 'r990: "x"\n'
    )
    t0 = time.monotonic()
    check_grammar(Guide(**big).spec(), LIMITS)
    check_grammar(Guide(regex="(ab|cd)" * 30_000).spec(), LIMITS)
    assert time.monotonic() - t0 < 10  # generous (well under a second here)


class _Tok:
    def __init__(self, hf) -> None:
        self.hf = hf
        self.eos_token_ids = {2}


@pytest.fixture(scope="module")
def manager_of(smollm2_hf_tokenizer):
    managers = []

    def make(**limits) -> StructuredOutputManager:
        m = StructuredOutputManager(
            "guidance",
            _Tok(smollm2_hf_tokenizer),
            len(smollm2_hf_tokenizer),
            limits=GrammarLimits(**limits),
        )
        managers.append(m)
        return m

    yield make
    for m in managers:
        m.shutdown()


def test_first_step_probe_refuses_what_fails_mid_generation(manager_of):
    """With the Python limits raised, llguidance's own limits trip on the first token; the
    probe turns that into a compile error instead of 'the grammar rejected token N'."""
    m = manager_of(max_repeat=10**9, max_bytes=10**7)
    for guide in (dict(regex="a{1000}{1000}"), dict(regex="x" * 1_000_000)):
        with pytest.raises(GrammarLimitError, match="too complex to generate"):
            m.precompile(Guide(**guide)).result(timeout=120)
    assert m.precompile(Guide(regex="[0-9]{3}")).result(timeout=60) is not None


def test_cycles_llguidance_resolves_to_nothing_are_refused_by_the_probe(manager_of):
    m = manager_of()
    guide = Guide(
        json={"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}}
    )
    with pytest.raises(GrammarLimitError, match="can never be satisfied"):
        m.precompile(guide).result(timeout=60)


def test_deep_chain_compiles_on_the_big_stack_without_crashing(tiny_llama_dir):
    """20,000 chained rules (limits raised) overflowed the native stack of an 8 MiB thread:
    a segfault. On a compile thread it is refused by the probe, and the process lives."""
    code = textwrap.dedent(f"""
        from transformers import AutoTokenizer
        from tokenmill.structured_output import StructuredOutputsParams as Guide
        from tokenmill.structured_output.limits import GrammarLimits, GrammarLimitError
        from tokenmill.structured_output.manager import StructuredOutputManager
        class Tok:
            hf = AutoTokenizer.from_pretrained({str(tiny_llama_dir)!r})
            eos_token_ids = {{2}}
        m = StructuredOutputManager("guidance", Tok(), len(Tok.hf),
                                    limits=GrammarLimits(max_bytes=10**7, max_rules=10**6))
        n = 20000
        g = Guide(grammar="start: r0\\n" + "".join(f'r{{i}}: "t{{i}}" | r{{i+1}}\\n'
                                                   for i in range(n)) + f'r{{n}}: "end"\\n')
        m.validate(g)
        try:
            m.precompile(g).result()
        except GrammarLimitError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "too complex" in out.stdout


def test_compile_timeout_is_an_error_naming_the_flag(manager_of):
    m = manager_of(compile_timeout=0.2)
    release = threading.Event()

    class Slow:
        def validate(self, spec):
            release.wait(5)

        def compile(self, spec):
            release.wait(5)
            raise AssertionError("not reached in time")

    m._backend = Slow()  # the manager's lazily built backend, replaced by a slow one
    with pytest.raises(GrammarLimitError, match="--grammar-compile-timeout"):
        m.validate(Guide(regex="a+"))
    release.set()


def test_grammar_cache_is_lru_by_bytes():
    cache: GrammarCache[str] = GrammarCache(max_bytes=100)
    futures = {}
    for key in "abcd":
        f: Future[str] = Future()
        futures[key] = cache.get_or_start(key, lambda f=f: f)
    for key in "abc":
        futures[key].set_result(key)
        cache.set_cost(key, futures[key], 40)
    assert "a" not in cache and "b" in cache and "c" in cache  # 120 > 100: oldest out
    assert "d" in cache  # still compiling: never evicted
    cache.get_or_start("b", lambda: Future())  # b is now the most recent
    futures["d"].set_result("d")
    cache.set_cost("d", futures["d"], 40)
    assert "c" not in cache and "b" in cache and cache.num_bytes == 80


def test_fifty_big_grammars_leave_rss_bounded(manager_of):
    """Each grammar (a 100 kB alternation of words) holds about 5.5 MB once compiled: 50 of
    them kept would be ~275 MB. With a 16 MiB cache, RSS grows by far less."""
    import random

    m = manager_of(cache_bytes=16 * 2**20)
    m.precompile(Guide(regex="warm")).result(timeout=120)  # the tokenizer trie, once
    rng = random.Random(0)
    before = resident_bytes()
    for i in range(50):
        words = "|".join("".join(rng.choice("abcdefghij") for _ in range(12)) for _ in range(8000))
        m.precompile(Guide(regex=f"({words})+ end{i}")).result(timeout=120)
    grown = resident_bytes() - before
    assert m.cache_bytes <= 16 * 2**20 + 8 * 2**20
    assert grown < 150 * 2**20, f"RSS grew by {grown >> 20} MiB"
