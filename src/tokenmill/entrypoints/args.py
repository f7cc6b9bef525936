"""Command-line flags, declared once as tables: engine options and sampling options."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2**40,
}


def memory_size(text: str) -> int:
    """'4GiB', '512MB', '1073741824' -> bytes."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 2GiB or 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def json_object(text: str) -> dict[str, Any]:
    """A JSON object flag value ('{"method": "ngram"}') -> dict."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


@dataclass(frozen=True)
class Flag:
    name: str
    dest: str
    type: Callable[[str], Any] | None
    help: str
    default: Any = None
    action: str | type[argparse.Action] | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()


ENGINE_FLAGS = (
    Flag(
        "--model",
        "model",
        str,
        "HF checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    ),
    Flag(
        "--tokenizer",
        "tokenizer",
        str,
        "HF tokenizer folder to use instead of the checkpoint's own",
    ),
    Flag(
        "--dtype",
        "dtype",
        str,
        "weights/compute dtype: auto (float32 on CPU, bfloat16 on CUDA; see --quantization), float32, bfloat16, float16",
        "auto",
    ),
    Flag("--device", "device", str, "auto, cpu, cuda or cuda:N", "auto"),
    Flag(
        "--attention-backend",
        "attention_backend",
        str,
        "paged attention kernels: auto (triton on CUDA when installed, native for quantized float32 models on CPU, else reference), reference (pure PyTorch), triton, native (CPU C kernels, float32)",
        "auto",
        choices=("auto", "reference", "triton", "native"),
    ),
    Flag(
        "--quantization",
        "quantization",
        str,
        "weight format: auto (on CPU a GGUF keeps its quantized weights unless --dtype float32/float16), none (dense), gguf, int8, int4",
        "auto",
        choices=("auto", "none", "gguf", "int8", "int4"),
    ),
    Flag(
        "--activation-precision",
        "activation_precision",
        str,
        "how the CPU int4/int8 kernels (GGUF, --quantization int8/int4) quantize activations: high (two int8 terms per group of 32, ~15 bits; the default) or low (one int8 term, as llama.cpp: faster speculative verification, batches and prefill, at a small quality cost)",
        "high",
        choices=("high", "low"),
    ),
    Flag(
        "--max-model-len",
        "max_model_len",
        int,
        "longest prompt + output in tokens; may only lower the model's own limit",
    ),
    Flag("--max-num-seqs", "max_num_seqs", int, "most requests batched in one engine step", 256),
    Flag(
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        int,
        "token budget of one step; long prompts are prefilled in chunks of this size (default max(2048, max-num-seqs))",
    ),
    Flag("--block-size", "block_size", int, "tokens per KV cache block", 16),
    Flag(
        "--kv-cache-memory",
        "kv_cache_memory_bytes",
        memory_size,
        "memory for the KV cache, e.g. 2GiB (default 1GiB, or enough for one max-model-len sequence)",
    ),
    Flag(
        "--num-kv-blocks",
        "num_kv_blocks",
        int,
        "exact number of KV cache blocks (overrides --kv-cache-memory)",
    ),
    Flag(
        "--ssm-state-cache-size",
        "ssm_state_cache_size",
        int,
        "hybrid and state-space models: number of recurrent-state slots, one per running request (not with --ssm-full-memory-ratio)",
    ),
    Flag(
        "--ssm-full-memory-ratio",
        "ssm_full_memory_ratio",
        float,
        "hybrid models: recurrent-state memory as a multiple of the full-attention KV cache memory (default 1.0, at most --max-num-seqs slots; not with --ssm-state-cache-size)",
    ),
    Flag(
        "--recurrent-snapshot-pool-bytes",
        "recurrent_snapshot_pool_bytes",
        memory_size,
        "hybrid and state-space models' prefix caching: memory for recurrent-state snapshots (taken every 64 tokens and at each prompt's end, least recently used evicted; 0: none; default: as much as the state slots)",
    ),
    Flag(
        "--enforce-eager",
        "enforce_eager",
        None,
        "never capture or replay CUDA graphs (decode steps on CUDA otherwise replay one graph per batch-size bucket)",
        False,
        action="store_true",
    ),
    Flag(
        "--async-scheduling",
        "async_scheduling",
        str,
        "schedule each step while the previous one runs on the device, hiding the host's per-step work: auto (on for CUDA), on, off; requests with structured output, penalties or min_tokens still step synchronously",
        "auto",
        choices=("auto", "on", "off"),
    ),
    Flag("--seed", "seed", int, "seed for requests that do not set their own", 0),
    Flag("--served-model-name", "served_model_name", str, "model name reported to clients"),
    Flag(
        "--structured-outputs-backend",
        "structured_outputs_backend",
        str,
        "grammar backend of structured output: auto or guidance (llguidance)",
        "auto",
    ),
    Flag(
        "--reasoning-parser",
        "reasoning_parser",
        str,
        "how reasoning is delimited in the output (think, deepseek_r1, qwen3, mistral); auto: from the chat template; none: off",
        "auto",
    ),
    Flag(
        "--speculative-config",
        "speculative_config",
        json_object,
        'speculative decoding as JSON, vLLM\'s keys: {"method": "ngram" | "suffix" | "draft_model" | "eagle3" | "mtp", "num_speculative_tokens": k, "model": DRAFT or EAGLE-3 HEAD FOLDER, "prompt_lookup_min": .., "prompt_lookup_max": .., "draft_top_k": 2, "verify_tree_size": 8 (draft trees: every method but draft_model)}; the engine drafts fewer tokens per step (or none) where more would not pay; greedy output is unchanged',
    ),
    Flag(
        "--speculative-method",
        "speculative_method",
        str,
        "flat form of --speculative-config's method (not together with it)",
    ),
    Flag(
        "--draft-model-id-or-path",
        "draft_model_id_or_path",
        str,
        "flat form of --speculative-config's model: the draft checkpoint (same vocabulary as the target)",
    ),
    Flag(
        "--num-speculative-tokens",
        "num_speculative_tokens",
        int,
        "flat form of --speculative-config's num_speculative_tokens: most drafts per request per step",
    ),
    Flag(
        "--draft-top-k",
        "draft_top_k",
        int,
        "draft trees: guesses per position, verified together in one step (every method but draft_model)",
    ),
    Flag(
        "--verify-tree-size",
        "verify_tree_size",
        int,
        "draft trees: most nodes verified per request per step (default depth x draft_top_k)",
    ),
    Flag(
        "--enable-prefix-caching",
        "enable_prefix_caching",
        None,
        "reuse the KV cache of earlier requests that share a prefix (--no-enable-prefix-caching: off)",
        True,
        action=argparse.BooleanOptionalAction,
    ),
    Flag(
        "--long-prefill-token-threshold",
        "long_prefill_token_threshold",
        int,
        "largest prefill chunk of one request per step, so long prompts never stall running decodes",
    ),
    Flag(
        "--max-logprobs",
        "max_logprobs",
        int,
        "most logprobs / prompt_logprobs alternatives a request may ask for",
        20,
    ),
    Flag(
        "--runner",
        "runner",
        str,
        "generate, pooling (embeddings, scores, classes: /v1/embeddings, /rerank, ...), or auto: pooling for an encoder or a sentence-transformers folder",
        "auto",
        choices=("auto", "generate", "pooling"),
    ),
    Flag(
        "--convert",
        "convert",
        str,
        "pooling head: embed, classify, or auto (classify for *ForSequenceClassification)",
        "auto",
        choices=("auto", "embed", "classify"),
    ),
    Flag(
        "--pooler-config",
        "pooler_config",
        json_object,
        'pooling overrides as JSON: {"pooling_type": "MEAN" | "CLS" | "LAST" | "MAX", "normalize": bool, "dimensions": n}',
    ),
    Flag(
        "--limit-mm-per-prompt",
        "limit_mm_per_prompt",
        json_object,
        'most media items per prompt, as JSON: {"image": 4} (default 8 images)',
    ),
    Flag(
        "--mm-processor-kwargs",
        "mm_processor_kwargs",
        json_object,
        'image-processor options for every request, as JSON: {"min_pixels": .., "max_pixels": ..}',
    ),
    Flag(
        "--mm-encoder-cache-bytes",
        "mm_encoder_cache_bytes",
        memory_size,
        "byte budget of the encoder cache (media embeddings by content hash)",
        256 << 20,
    ),
    Flag(
        "--max-num-encoder-input-tokens",
        "max_num_encoder_input_tokens",
        int,
        "media tokens one step may encode (default: the step's token budget)",
    ),
    Flag(
        "--max-visual-tokens-per-prompt",
        "max_visual_tokens_per_prompt",
        int,
        "placeholder tokens one prompt's images and videos may take together (videos sample fewer frames to fit)",
    ),
    Flag(
        "--allowed-local-media-path",
        "allowed_local_media_path",
        str,
        "file:// image URLs must resolve inside this folder (default: file:// is refused)",
    ),
    Flag(
        "--media-fetch",
        "allow_media_fetch",
        None,
        "fetch http(s) image URLs (--no-media-fetch: refuse them)",
        True,
        action=argparse.BooleanOptionalAction,
    ),
    Flag(
        "--media-max-bytes",
        "media_max_bytes",
        memory_size,
        "largest encoded media item: data URL, file or download",
        20 << 20,
    ),
    Flag(
        "--media-fetch-timeout",
        "media_fetch_timeout",
        float,
        "seconds one http(s) media fetch may take",
        10.0,
    ),
    Flag(
        "--prepare-bundle",
        "prepare_bundle",
        None,
        "start from a prepared bundle of the model in --cache-dir (mapped weights, same logits), written on the first start (CPU; on by default; --no-prepare-bundle: every start cold, nothing written)",
        True,
        action=argparse.BooleanOptionalAction,
    ),
    Flag(
        "--cache-dir",
        "cache_dir",
        str,
        "folder of the prepared bundles (default: $TOKENMILL_CACHE_DIR/bundles)",
    ),
    Flag(
        "--engine-cache-max-size-gb",
        "engine_cache_max_size_gb",
        float,
        "size cap of --cache-dir; least recently used bundles not in use are removed",
        50.0,
    ),
    Flag(
        "--clear-engine-cache",
        "clear_engine_cache",
        None,
        "remove every bundle of --cache-dir not in use before loading",
        False,
        action="store_true",
    ),
    Flag(
        "--tensor-parallel-size",
        "tensor_parallel_size",
        int,
        "processes (one device each) that split every layer of the model; this one is rank 0",
        1,
        aliases=("-tp",),
    ),
    Flag(
        "--pipeline-parallel-size",
        "pipeline_parallel_size",
        int,
        "processes that each run a stage of the layers; the last (with the sampler) is this one",
        1,
        aliases=("-pp",),
    ),
    Flag(
        "--data-parallel-size",
        "data_parallel_size",
        int,
        "engine replicas behind this server, each a Ray actor (pip install 'tokenmill[ray]')",
        1,
        aliases=("-dp",),
    ),
    Flag(
        "--ray-address",
        "ray_address",
        str,
        "the Ray cluster the replicas (or the Ray ranks) join (default: the running one, else "
        "start a local one)",
    ),
    Flag(
        "--data-parallel-routing",
        "data_parallel_routing",
        str,
        "how a request picks its replica: cache_aware (longest cached prefix, balanced "
        "with load) or round_robin",
        "cache_aware",
        choices=("cache_aware", "round_robin"),
    ),
    Flag(
        "--distributed-executor-backend",
        "distributed_executor_backend",
        str,
        "how tensor / pipeline-parallel ranks run: mp (worker processes of this machine) or "
        "ray (Ray actors, on the cluster --ray-address names, else a local one)",
        choices=("mp", "ray"),
    ),
)
GENERATION_CONFIG_HELP = (
    "default sampling parameters: auto (the checkpoint's "
    "generation_config.json), vllm (library defaults) or a folder holding "
    "a generation_config.json"
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

SERVER_FLAGS = (
    Flag(
        "--host",
        "host",
        str,
        "address to listen on; 0.0.0.0 exposes the server to the network",
        "127.0.0.1",
    ),
    Flag("--port", "port", int, "TCP port to listen on (0 = any free port)", 8000),
    Flag(
        "--api-key",
        "api_key",
        str,
        "require 'Authorization: Bearer KEY' on every route except /health",
    ),
    Flag(
        "--max-queued-requests",
        "max_queued_requests",
        int,
        "requests waiting to start beyond this are refused at once with HTTP 429 and Retry-After",
        1024,
    ),
    Flag(
        "--queue-timeout",
        "queue_timeout",
        float,
        "seconds a request may wait to start before it is refused with HTTP 503 (default: no limit)",
    ),
    Flag(
        "--log-level",
        "log_level",
        str,
        "log level of the server and the engine",
        "info",
        choices=LOG_LEVELS,
    ),
    Flag(
        "--tool-call-parser",
        "tool_call_parser",
        str,
        "how tool calls are read from the output (hermes, llama3_json, mistral, pythonic, json); auto: from the chat template",
        "auto",
    ),
    Flag(
        "--chat-template",
        "chat_template",
        str,
        "a Jinja chat template (a file, or the template itself) used instead of the model's own",
    ),
    Flag("--generation-config", "generation_config", str, GENERATION_CONFIG_HELP, "auto"),
    Flag(
        "--enable-auto-tool-choice",
        "enable_auto_tool_choice",
        None,
        "accepted for vLLM compatibility: tool_choice=auto is always on when a request sends tools",
        False,
        action="store_true",
    ),
    Flag(
        "--enable-log-requests",
        "log_requests",
        None,
        "log each request (prompt cut to --max-log-len, sampling parameters)",
        False,
        action="store_true",
    ),
    Flag(
        "--disable-log-requests",
        "disable_log_requests",
        None,
        "do not log requests (the default; vLLM's older flag)",
        False,
        action="store_true",
    ),
    Flag(
        "--max-log-len",
        "max_log_len",
        int,
        "characters of a prompt shown in request logs (default: all)",
    ),
    Flag(
        "--uvicorn-log-level",
        "uvicorn_log_level",
        str,
        "uvicorn's own log level (default: --log-level)",
        choices=LOG_LEVELS + ("trace",),
    ),
    Flag(
        "--response-role",
        "response_role",
        str,
        "role of the generated message: assistant only",
        "assistant",
        choices=("assistant",),
    ),
    Flag(
        "--disable-fastapi-docs",
        "disable_fastapi_docs",
        None,
        "no /docs, /redoc and /openapi.json",
        False,
        action="store_true",
    ),
    Flag(
        "--engine-process",
        "engine_process",
        str,
        "run the engine in its own process behind the server (on; vLLM's and SGLang's engine core) or in a thread of the server process (off); auto: off (the thread measured faster on a 2-core CPU machine; docs/architecture.md)",
        "auto",
        choices=("auto", "on", "off"),
    ),
    Flag(
        "--responses-store-size",
        "responses_store_size",
        int,
        "most /v1/responses kept in memory for GET, input_items and previous_response_id (the oldest are forgotten first; lost on restart)",
        1024,
    ),
    Flag(
        "--responses-store-max-age",
        "responses_store_max_age",
        float,
        "seconds a stored /v1/responses response is kept",
        3600.0,
    ),
)

SAMPLING_FLAGS = (
    Flag("--max-tokens", "max_tokens", int, "most tokens to generate", 256),
    Flag(
        "--temperature",
        "temperature",
        float,
        "0 = greedy (default: the model's generation_config, else 1.0)",
    ),
    Flag(
        "--top-p",
        "top_p",
        float,
        "nucleus sampling: keep the smallest set of tokens with this total probability",
    ),
    Flag("--top-k", "top_k", int, "keep only the k most likely tokens (0 = off)"),
    Flag("--min-p", "min_p", float, "drop tokens less likely than min-p times the most likely one"),
    Flag(
        "--repetition-penalty",
        "repetition_penalty",
        float,
        "> 1 discourages repeating prompt and output tokens",
    ),
    Flag("--stop", "stop", str, "stop when this string is generated (repeatable)", action="append"),
    Flag(
        "--ignore-eos",
        "ignore_eos",
        None,
        "keep generating past the end-of-sequence token",
        action="store_true",
    ),
    Flag("--sampling-seed", "seed", int, "per-request seed for reproducible sampling"),
)


def add_flags(parser: argparse.ArgumentParser, flags: tuple[Flag, ...], prefix: str = "") -> None:
    for f in flags:
        kwargs: dict[str, Any] = {"dest": prefix + f.dest, "help": f.help, "default": f.default}
        if f.action:
            kwargs["action"] = f.action
        if f.type is not None and f.action is None:
            kwargs["type"] = f.type
            kwargs["metavar"] = f.dest.upper()
        if f.choices:
            kwargs["choices"] = f.choices
            kwargs["metavar"] = "{" + ",".join(f.choices) + "}"
        if f.default is not None and f.action is None:
            kwargs["help"] += f" (default: {f.default})"
        parser.add_argument(f.name, *f.aliases, **kwargs)


def compat_flags() -> tuple[Flag, ...]:
    """vLLM's engine flags that tokenmill accepts (``tokenmill.vllm_compat``)."""
    from tokenmill.vllm_compat import COMPAT_OPTIONS

    aliases: dict[str, tuple[str, ...]] = {}
    return tuple(
        Flag(
            "--" + o.name.replace("_", "-"),
            o.name,
            o.type,
            o.meaning,
            o.default,
            action="store_true" if o.type is None else None,
            aliases=aliases.get(o.name, ()),
        )
        for o in COMPAT_OPTIONS
    )


def add_engine_flags(group) -> None:
    """Engine flags, then vLLM's compatible ones (documented as such in --help)."""
    add_flags(group, ENGINE_FLAGS)
    add_flags(group, compat_flags())


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) options: the engine flags, and vLLM's compatible ones when present."""
    opts = {f.dest: getattr(args, f.dest) for f in ENGINE_FLAGS if f.dest != "model"}
    opts.update({f.dest: getattr(args, f.dest) for f in compat_flags() if hasattr(args, f.dest)})
    return opts


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """Only the sampling flags the user actually set (the rest come from the model)."""
    opts = {}
    for f in SAMPLING_FLAGS:
        value = getattr(args, "s_" + f.dest)
        if value is not None and value is not False:
            opts[f.dest] = value
    return opts


SERVER_ONLY_FLAGS = frozenset({"enable_auto_tool_choice", "disable_log_requests", "response_role"})
"""Accepted for vLLM compatibility, with nothing to configure (see their help)."""


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    opts = {f.dest: getattr(args, f.dest) for f in SERVER_FLAGS if f.dest not in SERVER_ONLY_FLAGS}
    if getattr(args, "disable_log_requests", False):
        opts["log_requests"] = False
    return opts
