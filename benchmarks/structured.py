"""Structured output: throughput with a JSON schema vs unconstrained, and grammar compile time.

    python benchmarks/structured.py [--model PATH] [--concurrency 16] [--max-tokens 64]

Both runs generate from the same chat prompts at the same concurrency, greedy, and
every request produces exactly ``--max-tokens`` tokens: the schema asks for a long
list, so the constrained requests also end on the token budget and the two runs
do the same model work; the difference is the grammar's cost (mask computation,
masking, advancing the matchers). Compile times are per schema, from a cold cache
(the first compile also builds the tokenizer's token trie, reported apart).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.structured_output import StructuredOutputsParams  # noqa: E402

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "quantity": {"type": "integer", "minimum": 0, "maximum": 999},
        "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "category": {"enum": ["food", "tools", "toys", "books"]},
    },
    "required": ["name", "quantity", "price", "category"],
}
INVENTORY = {
    "type": "object",
    "properties": {
        "store": {"type": "string", "maxLength": 24},
        "items": {"type": "array", "items": ITEM, "minItems": 100},
    },
    "required": ["store", "items"],
}

COMPILE_SCHEMAS = {
    "inventory (nested, array)": INVENTORY,
    "person (3 fields)": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["name", "age"],
    },
    "enum": {"enum": ["red", "green", "blue"]},
    "bounded numbers": {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
        },
    },
    "anyOf + $defs": {
        "$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer"}}}},
        "anyOf": [{"$ref": "#/$defs/leaf"}, {"type": "array", "items": {"$ref": "#/$defs/leaf"}}],
    },
    "json_object": None,
}

TOPICS = [
    "a hardware store",
    "a bakery",
    "a toy shop",
    "a bookshop",
    "a market stall",
    "a pharmacy",
    "a garden centre",
    "a kiosk",
]


def prompts(llm: LLM, n: int) -> list[dict]:
    out = []
    for i in range(n):
        text = f"List the inventory of {TOPICS[i % len(TOPICS)]} number {i} as JSON."
        out.append(
            {
                "prompt_token_ids": llm.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}]
                )
            }
        )
    return out


def timed_runs(
    llm: LLM, batch: list[dict], runs: dict[str, SamplingParams], repeat: int
) -> dict[str, float]:
    """Median tokens/s per run; the runs alternate, so load drift hits them alike."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, params in runs.items():
            start = time.perf_counter()
            outs = llm.generate(batch, params)
            seconds = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    return {name: statistics.median(r) for name, r in rates.items()}


class GrammarClock:
    """Wall time of the grammar work in the engine: mask fill (background thread), mask
    application (sampler) and advancing the matchers, per engine step."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = {"fill": 0.0, "apply": 0.0, "advance": 0.0}
        self.steps = 0
        manager, engine = llm.engine.structured, llm.engine
        for key, owner, name in (
            ("fill", manager, "_fill"),
            ("advance", manager, "advance"),
            (None, engine, "step"),
        ):
            setattr(owner, name, self._wrap(key, getattr(owner, name)))
        sampler = engine.runner.sampler  # holds the processor itself, not the attribute
        sampler.processors = tuple(
            self._wrap("apply", p) if p == manager.mask_logits else p for p in sampler.processors
        )

    def _wrap(self, key, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if key is None:
                    self.steps += 1
                else:
                    self.seconds[key] += time.perf_counter() - start

        return timed

    def per_step_ms(self) -> dict[str, float]:
        return {k: v * 1e3 / max(self.steps, 1) for k, v in self.seconds.items()}


def compile_times(llm: LLM) -> list[list[str]]:
    manager = llm.engine.structured
    backend = manager.backend
    start = time.perf_counter()
    backend.ll_tokenizer  # noqa: B018 - built on the first compile
    rows = [["tokenizer trie (once per engine)", f"{(time.perf_counter() - start) * 1e3:.0f}"]]
    for name, schema in COMPILE_SCHEMAS.items():
        guide = (
            StructuredOutputsParams(json_object=True)
            if schema is None
            else StructuredOutputsParams(json=schema)
        )
        spec = guide.spec()
        start = time.perf_counter()
        backend.validate(spec)
        backend.compile(spec)
        rows.append([name, f"{(time.perf_counter() - start) * 1e3:.1f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    # the defaults a CPU user gets (a GGUF stays quantized); no prefix cache, so every run
    # pays its prefill alike
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, enable_prefix_caching=False)
    print("grammar compile time, cold cache (ms):")
    print(table([["schema", "ms"], *compile_times(llm)]))

    batch = prompts(llm, args.concurrency)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    guided = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=INVENTORY),
    )
    llm.generate(batch[:2], [plain, guided])  # warm-up (and the inventory grammar's compile)
    rates = timed_runs(llm, batch, {"unconstrained": plain, "JSON schema": guided}, args.repeat)
    free, constrained = rates["unconstrained"], rates["JSON schema"]
    print(
        f"\n{args.concurrency} concurrent requests x {args.max_tokens} tokens, greedy "
        f"(median of {args.repeat}, alternating):"
    )
    print(
        table(
            [
                ["run", "tokens/s", "vs unconstrained"],
                ["unconstrained", f"{free:.1f}", "1.00"],
                ["JSON schema", f"{constrained:.1f}", f"{constrained / free:.2f}"],
            ]
        )
    )
    clock = GrammarClock(llm)
    start = time.perf_counter()
    llm.generate(batch, guided)
    step_ms = (time.perf_counter() - start) * 1e3 / max(clock.steps, 1)
    parts = clock.per_step_ms()
    print(
        f"\ngrammar work per engine step (ms; a step takes {step_ms:.1f}): "
        + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
        + " (fill overlaps the forward pass)"
    )


if __name__ == "__main__":
    main()
