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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, table  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.structured_output import StructuredOutputsParams  # noqa: E402

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "quantity": {"type": "integer", "minimum": 0, "maximum": 999},
    "price": {"type": "number", "minimum": 0, "maximum": 10000},
    "category": {"enum": ["food", "tools", "toys", "books"]}},
    "required": ["name", "quantity", "price", "category"]}
INVENTORY = {"type": "object", "properties": {
    "store": {"type": "string", "maxLength": 24},
    "items": {"type": "array", "items": ITEM, "minItems": 100}},
    "required": ["store", "items"]}

COMPILE_SCHEMAS = {
    "inventory (nested, array)": INVENTORY,
    "person (3 fields)": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"}}, "required": ["name", "age"]},
    "enum": {"enum": ["red", "green", "blue"]},
    "bounded numbers": {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180}}},
    "anyOf + $defs": {"$defs": {"leaf": {"type": "object", "properties": {
        "v": {"type": "integer"}}}}, "anyOf": [{"$ref": "#/$defs/leaf"},
                                              {"type": "array", "items": {"$ref": "#/$defs/leaf"}}]},
    "json_object": None,
}

TOPICS = ["a hardware store", "a bakery", "a toy shop", "a bookshop", "a market stall",
          "a pharmacy", "a garden centre", "a kiosk"]


def prompts(llm: LLM, n: int) -> list[dict]:
    out = []
    for i in range(n):
        text = f"List the inventory of {TOPICS[i % len(TOPICS)]} number {i} as JSON."
        out.append({"prompt_token_ids": llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}])})
    return out


def throughput(llm: LLM, batch: list[dict], params: SamplingParams, repeat: int) -> float:
    tokens = 0

    def run() -> None:
        nonlocal tokens
        outs = llm.generate(batch, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)

    seconds = best_of(run, repeat)
    return tokens / seconds


def compile_times(llm: LLM) -> list[list[str]]:
    manager = llm.engine.structured
    backend = manager.backend
    start = time.perf_counter()
    backend.ll_tokenizer  # noqa: B018 - built on the first compile
    rows = [["tokenizer trie (once per engine)", f"{(time.perf_counter() - start) * 1e3:.0f}"]]
    for name, schema in COMPILE_SCHEMAS.items():
        guide = (StructuredOutputsParams(json_object=True) if schema is None
                 else StructuredOutputsParams(json=schema))
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
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    llm = LLM(args.model, dtype="float32", max_model_len=1024, enable_prefix_caching=False)
    print("grammar compile time, cold cache (ms):")
    print(table([["schema", "ms"], *compile_times(llm)]))

    batch = prompts(llm, args.concurrency)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                            structured_outputs=StructuredOutputsParams(json=INVENTORY))
    llm.generate(batch[:2], [plain, guided])  # warm-up (and the inventory grammar's compile)
    free = throughput(llm, batch, plain, args.repeat)
    constrained = throughput(llm, batch, guided, args.repeat)
    print(f"\n{args.concurrency} concurrent requests x {args.max_tokens} tokens, greedy:")
    print(table([
        ["run", "tokens/s", "vs unconstrained"],
        ["unconstrained", f"{free:.1f}", "1.00"],
        ["JSON schema", f"{constrained:.1f}", f"{constrained / free:.2f}"],
    ]))


if __name__ == "__main__":
    main()
