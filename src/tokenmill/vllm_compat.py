"""vLLM engine options without a tokenmill counterpart, so that vLLM scripts and flags run.

Each option is either a documented no-op (accepted with any value; ``noop`` says why
it means nothing here) or accepted only at the values that leave results unchanged
(``only``): anything else raises ``ValueError`` naming what to do instead. Nothing is
accepted and silently dropped. ``LLM(...)``, ``EngineArgs`` and the command line all
read this one table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompatOption:
    name: str
    """The Python name (``--name-with-dashes`` on the command line)."""
    default: Any
    type: Callable[[str], Any] | None
    """Command-line parser of a value; None: a boolean flag."""
    meaning: str
    """What the option does in tokenmill (shown in ``--help``)."""
    only: tuple[Any, ...] = ()
    """Accepted values (empty: any value, the option is a no-op)."""


def _bool(text: str) -> bool:
    return text.lower() in ("1", "true", "yes", "on")


TASKS: dict[str, dict[str, str]] = {
    "auto": {},
    "generate": {"runner": "generate"},
    "embed": {"runner": "pooling", "convert": "embed"},
    "embedding": {"runner": "pooling", "convert": "embed"},
    "classify": {"runner": "pooling", "convert": "classify"},
    "score": {"runner": "pooling"},  # the checkpoint's head decides (a cross-encoder scores)
    "transcription": {},  # a Whisper folder is detected as such
}
"""vLLM's ``task`` -> the ``runner`` / ``convert`` options it means."""

COMPAT_OPTIONS: tuple[CompatOption, ...] = (
    CompatOption(
        "gpu_memory_utilization",
        0.9,
        float,
        "no-op: the KV cache size is set by --kv-cache-memory or --num-kv-blocks "
        "(on CPU there is no GPU memory to share)",
    ),
    CompatOption(
        "trust_remote_code",
        False,
        None,
        "no-op: tokenmill never runs code shipped with a checkpoint; supported "
        "architectures are built in",
    ),
    CompatOption(
        "swap_space",
        4,
        float,
        "no-op: preempted requests are recomputed (mostly from the prefix cache), "
        "never swapped to CPU memory",
    ),
    CompatOption("cpu_offload_gb", 0, float, "weights are never offloaded: only 0", only=(0, 0.0)),
    CompatOption(
        "disable_log_stats",
        False,
        None,
        "no-op: stats are kept for /metrics and never logged periodically",
    ),
    CompatOption(
        "enable_chunked_prefill",
        None,
        _bool,
        "no-op: long prompts are always prefilled in chunks (see --long-prefill-token-threshold)",
    ),
    CompatOption(
        "max_seq_len_to_capture",
        None,
        int,
        "no-op: CUDA graphs capture decode steps, whatever the context length",
    ),
    CompatOption("disable_custom_all_reduce", False, None, "no-op: one device, no all-reduce"),
    CompatOption(
        "download_dir", None, str, "no-op: models are local paths (there is no model hub download)"
    ),
    CompatOption(
        "load_format",
        "auto",
        str,
        "auto only: the format follows the path (a .gguf file or a safetensors folder)",
        only=("auto", "safetensors", "gguf"),
    ),
    CompatOption(
        "tokenizer_mode",
        "auto",
        str,
        "auto only: the checkpoint's fast tokenizer (or the GGUF's)",
        only=("auto", "hf"),
    ),
    CompatOption(
        "revision",
        None,
        str,
        "no model hub: only unset (check out the revision you want locally)",
        only=(None,),
    ),
    CompatOption("tokenizer_revision", None, str, "no model hub: only unset", only=(None,)),
    CompatOption(
        "kv_cache_dtype",
        "auto",
        str,
        "auto only: the KV cache is kept in the compute dtype",
        only=("auto",),
    ),
    CompatOption(
        "enable_lora", False, None, "LoRA adapters are not supported: only off", only=(False,)
    ),
    CompatOption(
        "task",
        "auto",
        str,
        "vLLM's older name of runner/convert: generate, embed (or embedding), classify, "
        "score (a pooling model), transcription (a Whisper folder); reward is not built",
        only=tuple(TASKS),
    ),
    CompatOption(
        "scheduling_policy",
        "fcfs",
        str,
        "no-op: requests run by priority, then arrival (fcfs when no priority is given)",
        only=("fcfs", "priority"),
    ),
    CompatOption(
        "disable_async_output_proc",
        False,
        None,
        "no-op: outputs are processed while the next step runs when --async-scheduling is on",
    ),
)
BY_NAME = {o.name: o for o in COMPAT_OPTIONS}


def _apply_task(task: str, options: dict[str, Any]) -> None:
    for name, value in TASKS[task].items():
        given = options.get(name, "auto")
        if given not in ("auto", value):
            raise ValueError(f"task={task!r} means {name}={value!r}, but {name}={given!r} was set")
        options[name] = value


def check_compat_options(options: dict[str, Any]) -> dict[str, Any]:
    """Remove the vLLM-only options from ``options`` (in place) and return them.

    Raises ``ValueError`` for a value that tokenmill cannot honour; logs once (INFO) for
    a no-op option set to something other than its default.
    """
    taken = {name: options.pop(name) for name in list(options) if name in BY_NAME}
    for name, value in taken.items():
        opt = BY_NAME[name]
        if opt.only and value not in opt.only:
            raise ValueError(f"{name}={value!r} is not supported: {opt.meaning}")
        if not opt.only and value != opt.default:
            logger.info("%s=%r has no effect in tokenmill (%s)", name, value, opt.meaning)
    if "task" in taken:
        _apply_task(taken["task"], options)
    return taken
