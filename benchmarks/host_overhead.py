"""Host (Python) time per decode step, the part a fast GPU cannot hide.

    python benchmarks/host_overhead.py                    # 256 x (512 in, 64 out), padded decode
    python benchmarks/host_overhead.py --seqs 64 --out-tokens 128 --eager

On an H200 a decode step of the Llama-3.2-1B shape at 256 sequences takes ~2 ms of GPU
time (weights + KV reads at the bandwidth limit); every millisecond the engine spends in
Python between two steps is added to it, because the step's sampled ids are read back
before the next step is scheduled. This script measures that host time on any machine:
the model is replaced by a null model (zero hidden states, zero logits: no compute), so
what is left is scheduling, input building, sampling bookkeeping, output processing.
The phases are timed by wrapping the engine's own methods (the wrappers cost ~1 us each).

``--padded`` (default) runs all-decode steps through the CUDA-graph input path
(``PaddedDecode`` without capture), as on CUDA; ``--eager`` through ``build_step_inputs``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402
from gpu_models import build_tokenmill, shape_config, write_folder  # noqa: E402


class NullModel(nn.Module):
    """The model contract with no compute: hidden [T, H] and logits [N, V] of zeros."""

    def __init__(self, real: nn.Module, hidden: int, max_tokens: int) -> None:
        super().__init__()
        for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size"):
            setattr(self, name, getattr(real, name))
        for name in ("ops", "dtype", "cache_specs"):  # absent from older trees
            if hasattr(real, name):
                setattr(self, name, getattr(real, name))
        self.hidden = torch.zeros(max_tokens, hidden)
        self.logits = torch.zeros(max_tokens, real.vocab_size)

    def forward(self, input_ids, positions, ctx):
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]].clone()  # a new tensor, as a real lm_head makes


class Phases:
    """Wall time per named phase, accumulated by wrapping bound methods."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj: object, attr: str, name: str) -> None:
        """Time obj.attr under ``name``; skipped where obj has no such attribute (an older
        tree, measured side by side with PYTHONPATH=old/src)."""
        fn = getattr(obj, attr, None)
        if fn is None:
            return

        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - start

        setattr(obj, attr, timed)


def build_engine(args):
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.worker.cuda_graphs import PaddedDecode

    cfg = shape_config("tiny")
    cfg["vocab_size"] = args.vocab
    folder = write_folder(Path(tempfile.mkdtemp(prefix="tokenmill-host-")) / "m", cfg)
    needed = args.prompt_tokens + args.out_tokens + 16
    max_len = max(args.max_model_len or needed, needed)
    loaded = build_tokenmill(folder, cfg, torch.device("cpu"), torch.float32, max_len)
    null = NullModel(loaded.model, cfg["hidden_size"], max(8192, args.seqs * 4))
    loaded = dataclasses.replace(loaded, model=null)
    config = EngineConfig(
        model=str(folder), dtype="float32", device="cpu", max_model_len=max_len,
        max_num_seqs=args.seqs, max_num_batched_tokens=8192, enable_prefix_caching=args.prefix_caching,
        num_kv_blocks=args.seqs * -(-needed // 16) + 1,
    )  # fmt: skip
    engine = LLMEngine(config, loaded)
    runner = engine.runner
    if args.padded:
        runner.decode = PaddedDecode(
            runner.model, runner.kv_caches, config.block_size, max_len, args.seqs,
            runner.device, runner.backend, capture=False,
        )  # fmt: skip
    return engine


def instrument(engine) -> Phases:
    phases = Phases()
    phases.wrap(engine.scheduler, "schedule", "schedule")
    phases.wrap(engine.scheduler, "update", "update (scheduler)")
    phases.wrap(engine.runner, "execute", "execute (runner, older trees)")
    phases.wrap(engine.runner, "launch", "launch (runner)")
    phases.wrap(engine.runner, "collect", "collect (runner)")
    phases.wrap(engine.runner, "sampler", "  sampler")
    phases.wrap(engine.runner.model, "forward", "  model (null)")
    if engine.runner.decode is not None:
        phases.wrap(engine.runner.decode, "_upload", "  inputs (padded)")
        phases.wrap(engine.runner.decode, "_host_values", "  inputs (padded)")
    else:
        import tokenmill.worker.model_runner as mr

        phases.wrap(mr, "build_step_inputs", "  inputs")
    phases.wrap(engine.processor, "process_token", "process_token")
    phases.wrap(engine.processor, "process_tokens", "process_token")
    phases.wrap(engine.processor, "progress", "progress")
    phases.wrap(engine.processor, "finish", "finish")
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seqs", type=int, default=256, help="concurrent requests (default 256)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (default 512)")
    ap.add_argument(
        "--out-tokens", type=int, default=64, help="output tokens per request (default 64)"
    )
    ap.add_argument(
        "--vocab", type=int, default=32000, help="vocabulary of the null model (default 32000)"
    )
    ap.add_argument(
        "--eager",
        dest="padded",
        action="store_false",
        help="eager input path, not the padded (CUDA-graph) one",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="engine max_model_len: the padded path's block-table width (default: just enough; "
        "131072 is Llama 3's own limit, what a server gets by default)",
    )
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="turn the prefix cache on (off by default, as gpu_suite)",
    )
    ap.add_argument(
        "--penalties",
        action="store_true",
        help="every request with frequency and presence penalties (their token counts)",
    )
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the decode steps")
    args = ap.parse_args()

    from tokenmill import SamplingParams
    from tokenmill.sampling_params import RequestOutputKind

    torch.set_num_threads(1)  # host work is one thread; keep torch's pool out of the picture
    engine = build_engine(args)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        3, args.vocab - 1, (args.seqs, args.prompt_tokens), generator=g
    ).tolist()
    params = SamplingParams(
        temperature=0, max_tokens=args.out_tokens, ignore_eos=True, detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        **({"frequency_penalty": 0.5, "presence_penalty": 0.5} if args.penalties else {}),
    )  # fmt: skip
    for p in prompts:
        engine.add_request(p, params)
    while (
        any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values())
        or engine.scheduler.waiting
    ):
        engine.step()  # prefill: not what this script measures
    phases = instrument(engine)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    steps, start, cpu_start = 0, time.perf_counter(), time.process_time()
    per_step: list[float] = []  # CPU ms of each step: its low quantile resists a busy machine
    while engine.has_unfinished():
        before = time.process_time()
        engine.step()
        per_step.append((time.process_time() - before) * 1e3)
        steps += 1
    total = time.perf_counter() - start
    cpu = time.process_time() - cpu_start  # this process's CPU time: less noisy when shared
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    rows = [["phase", "ms / step", "share"]]
    for name, sec in phases.seconds.items():
        rows.append([name, f"{sec / steps * 1e3:.3f}", f"{sec / total:.0%}"])
    rows.append(["whole step", f"{total / steps * 1e3:.3f}", "100%"])
    rows.append(["whole step, CPU time", f"{cpu / steps * 1e3:.3f}", f"{cpu / total:.0%}"])
    quiet = sorted(per_step[:-1])[: max(1, steps // 5)]  # the last step finishes everyone
    rows.append(["CPU time, quietest 20% of steps", f"{sum(quiet) / len(quiet):.3f}", ""])
    path = "padded (CUDA-graph inputs)" if args.padded else "eager inputs"
    print(
        f"{args.seqs} sequences x {args.out_tokens - 1} decode steps, {path}, null model, one thread"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
