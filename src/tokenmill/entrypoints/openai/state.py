"""What the routes share: the server options, the model's name, and the engine once loaded."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.errors import APIError, unavailable
from tokenmill.entrypoints.openai.limits import ServerLimits
from tokenmill.sampling_params import SamplingParams, generation_defaults
from tokenmill.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServerConfig:
    """Options of the HTTP server (the engine's own options live in ``EngineConfig``)."""

    host: str = "127.0.0.1"
    """Address to listen on; 0.0.0.0 exposes the server to the network."""
    port: int = 8000
    """TCP port; 0 picks a free one."""
    api_key: str | None = None
    """When set, every route except /health needs ``Authorization: Bearer <key>``."""
    max_queued_requests: int | None = 1024
    """Requests waiting to start beyond this are refused with 429; None = no bound."""
    queue_timeout: float | None = None
    """Seconds a request may wait to start before it is refused with 503; None = forever."""
    log_level: str = "info"
    """uvicorn and tokenmill log level: critical, error, warning, info, debug."""
    tool_call_parser: str = "auto"
    """How tool calls are read from the model's text (hermes, llama3_json, mistral,
    pythonic, json); auto: chosen from the chat template."""
    limits: ServerLimits = field(default_factory=ServerLimits)
    """Bounds on what one request or connection may cost (``limits.py``)."""
    chat_template: str | None = None
    """A Jinja chat template, or the path of a file holding one, used instead of the
    model's own (a request's ``chat_template`` still wins)."""
    generation_config: str = "auto"
    """Default sampling parameters: auto (the checkpoint's generation_config.json), vllm
    (the library defaults) or a folder holding a generation_config.json."""
    log_requests: bool = False
    """Log each request: its id, prompt (cut to ``max_log_len``) and sampling parameters."""
    max_log_len: int | None = None
    """Characters of a prompt shown in request logs; None = all."""
    uvicorn_log_level: str | None = None
    """uvicorn's own log level; None = ``log_level``."""
    disable_fastapi_docs: bool = False
    """Serve no /docs, /redoc or /openapi.json."""
    engine_process: str = "auto"
    """Where the engine runs: on (its own process behind the server, the engine core of
    vLLM and SGLang), off (a thread of the server process), auto (``core_process.py``'s
    ``use_engine_process``; the measurement behind it is in docs/architecture.md)."""
    responses_store_size: int = 1024
    """Most /v1/responses kept in memory (store=true) for GET, input_items and
    previous_response_id; the oldest are forgotten first."""
    responses_store_max_age: float = 3600.0
    """Seconds a stored response is kept."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.queue_timeout is not None and self.queue_timeout <= 0:
            raise ValueError(f"queue_timeout must be > 0 seconds, got {self.queue_timeout}")
        if self.responses_store_size < 0 or self.responses_store_max_age <= 0:
            raise ValueError("responses_store_size must be >= 0 and responses_store_max_age > 0")
        if self.engine_process not in ("auto", "on", "off"):
            raise ValueError(f"engine_process must be auto, on or off, got {self.engine_process!r}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        if self.tool_call_parser != "auto":
            from tokenmill.parsers.tools import get_tool_parser

            get_tool_parser(self.tool_call_parser)


def _is_file(text: str) -> bool:
    """A --chat-template value is a path unless it looks like a template."""
    return "{" not in text and "\n" not in text and Path(text).is_file()


def model_name_of(path: str | None, served_model_name: str | None) -> str:
    """The name clients use: --served-model-name, else the checkpoint's file/folder name."""
    if served_model_name:
        return served_model_name
    if path is None:
        from tokenmill.loader.resolve import default_model_path

        path = default_model_path()
    name = Path(path).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


@dataclass
class ServerState:
    config: ServerConfig
    model_name: str
    llm: AsyncLLM | None = None
    """None while the model loads."""
    load_error: BaseException | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    template_override: str | None = field(init=False)
    """--chat-template's text (read once when it names a file)."""

    def __post_init__(self) -> None:
        text = self.config.chat_template
        self.template_override = Path(text).read_text() if text and _is_file(text) else text

    @property
    def ready(self) -> bool:
        return self.llm is not None and self.llm.is_ready and not self.draining

    def require_llm(self) -> AsyncLLM:
        if self.llm is None:
            raise unavailable(
                "the model is still loading; retry when GET /health says ok", "loading"
            )
        return self.llm

    @property
    def tokenizer(self) -> Tokenizer:
        return self.require_llm().tokenizer

    @property
    def max_model_len(self) -> int:
        return self.require_llm().engine.max_model_len

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the checkpoint's generation_config.json."""
        gen = self.require_llm().engine.loaded.checkpoint.generation_config
        return generation_defaults(self.config.generation_config, gen)

    @property
    def chat_template(self) -> str | None:
        """--chat-template, else the model's own."""
        return self.template_override or self.tokenizer.chat_template

    def check_model(self, name: str | None, required: bool = False) -> None:
        """``required``: OpenAI's completion routes make ``model`` a required field."""
        if not name and required:
            raise APIError(
                400,
                f'model is required: send "model": {self.model_name!r} '
                f"(the served model ids: [{self.model_name!r}]; see GET /v1/models)",
                param="model",
                code="missing_model",
            )
        if name and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{self.model_name!r} (see GET /v1/models)",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
