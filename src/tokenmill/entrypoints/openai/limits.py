"""``ServerLimits``: what one request (or one connection) may cost the server, and the flags
that set it. Every bound has a default that a normal client never meets."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from tokenmill.entrypoints.args import Flag, memory_size
from tokenmill.structured_output.limits import GrammarLimits

_G = GrammarLimits()


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on request bodies, prompts, templates, grammars, connections and shutdown."""

    max_request_body_bytes: int = 8 * 1024 * 1024
    """Larger bodies are refused with 413 before they are read in full."""
    trust_request_chat_template: bool = False
    """Render a request's own ``chat_template`` (off: such a request is a 400)."""
    chat_template_timeout: float = 5.0
    """Seconds a request's own chat template may render (when trusted)."""
    max_prompts_per_request: int = 256
    """Prompts in one /v1/completions request (a list of prompts)."""
    max_prompt_logprobs_cost: int = 16384
    """Prompt tokens times (prompt_logprobs + 1), per request: prompt logprobs cost a
    full-vocabulary row per prompt token."""
    preprocess_workers: int = 2
    """Threads that render chat templates and tokenize prompts off the event loop."""
    timeout_keep_alive: float = 5.0
    """Seconds an idle keep-alive connection stays open."""
    timeout_headers: float = 10.0
    """Seconds a client has to send a request's headers (slow clients are cut)."""
    limit_concurrency: int | None = 4096
    """Open connections plus running requests beyond which new requests get 503."""
    shutdown_timeout: float = 60.0
    """Seconds the drain may take after the first SIGTERM; what is left is then aborted."""
    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    """Bounds on a request's grammar (structured output)."""

    def __post_init__(self) -> None:
        for name in (
            "max_request_body_bytes",
            "max_prompts_per_request",
            "max_prompt_logprobs_cost",
            "preprocess_workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "chat_template_timeout",
            "timeout_keep_alive",
            "timeout_headers",
            "shutdown_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")


_S = ServerLimits()

LIMIT_FLAGS = (
    Flag(
        "--max-request-body-bytes",
        "max_request_body_bytes",
        memory_size,
        "largest request body; larger ones get HTTP 413",
        _S.max_request_body_bytes,
    ),
    Flag(
        "--trust-request-chat-template",
        "trust_request_chat_template",
        None,
        "render a chat_template sent in a request (off: such requests get 400)",
        False,
        action="store_true",
    ),
    Flag(
        "--chat-template-timeout",
        "chat_template_timeout",
        float,
        "seconds a request's own chat template may render",
        _S.chat_template_timeout,
    ),
    Flag(
        "--max-prompts-per-request",
        "max_prompts_per_request",
        int,
        "most prompts in one /v1/completions request",
        _S.max_prompts_per_request,
    ),
    Flag(
        "--max-prompt-logprobs-cost",
        "max_prompt_logprobs_cost",
        int,
        "most prompt tokens x (prompt_logprobs + 1) per request",
        _S.max_prompt_logprobs_cost,
    ),
    Flag(
        "--preprocess-workers",
        "preprocess_workers",
        int,
        "threads that template and tokenize requests off the event loop",
        _S.preprocess_workers,
    ),
    Flag(
        "--timeout-keep-alive",
        "timeout_keep_alive",
        float,
        "seconds an idle keep-alive connection stays open",
        _S.timeout_keep_alive,
    ),
    Flag(
        "--timeout-headers",
        "timeout_headers",
        float,
        "seconds a client has to send a request's headers",
        _S.timeout_headers,
    ),
    Flag(
        "--limit-concurrency",
        "limit_concurrency",
        int,
        "connections + running requests beyond which new requests get HTTP 503",
        _S.limit_concurrency,
    ),
    Flag(
        "--shutdown-timeout",
        "shutdown_timeout",
        float,
        "seconds the drain after SIGTERM may take before the rest is aborted",
        _S.shutdown_timeout,
    ),
    Flag(
        "--max-grammar-bytes",
        "max_grammar_bytes",
        memory_size,
        "largest grammar, schema, regex or choice list of a request",
        _G.max_bytes,
    ),
    Flag(
        "--max-grammar-rules",
        "max_grammar_rules",
        int,
        "most rules of a grammar ($defs of a JSON schema)",
        _G.max_rules,
    ),
    Flag(
        "--max-grammar-depth",
        "max_grammar_depth",
        int,
        "deepest nesting of a grammar, regex or JSON schema",
        _G.max_depth,
    ),
    Flag(
        "--max-grammar-repeat",
        "max_grammar_repeat",
        int,
        "largest product of nested counted repetitions (a{100}{100} = 10000)",
        _G.max_repeat,
    ),
    Flag(
        "--max-grammar-alternatives",
        "max_grammar_alternatives",
        int,
        "most choices / anyOf / enum entries",
        _G.max_alternatives,
    ),
    Flag(
        "--grammar-compile-timeout",
        "grammar_compile_timeout",
        float,
        "seconds a grammar may take to compile",
        _G.compile_timeout,
    ),
    Flag(
        "--grammar-cache-bytes",
        "grammar_cache_bytes",
        memory_size,
        "estimated memory of the compiled grammars kept for reuse",
        _G.cache_bytes,
    ),
)

_GRAMMAR_DESTS = {
    "max_grammar_bytes": "max_bytes",
    "max_grammar_rules": "max_rules",
    "max_grammar_depth": "max_depth",
    "max_grammar_repeat": "max_repeat",
    "max_grammar_alternatives": "max_alternatives",
    "grammar_compile_timeout": "compile_timeout",
    "grammar_cache_bytes": "cache_bytes",
}


def limit_options(args: argparse.Namespace) -> ServerLimits:
    """``ServerLimits`` from parsed ``LIMIT_FLAGS`` (missing ones keep their defaults)."""
    server: dict[str, Any] = {}
    grammar: dict[str, Any] = {}
    for f in LIMIT_FLAGS:
        if not hasattr(args, f.dest):
            continue
        value = getattr(args, f.dest)
        if f.dest in _GRAMMAR_DESTS:
            grammar[_GRAMMAR_DESTS[f.dest]] = value
        else:
            server[f.dest] = value
    return ServerLimits(**server, grammar=GrammarLimits(**grammar))
