"""The offline API: ``LLM(model).generate(...)`` / ``.chat(...)`` / ``.generate_stream(...)``."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.prompts import (
    PromptInput,
    normalize_prompts,
    params_per_prompt,
    request_options,
)
from tokenmill.errors import EngineDeadError, InvalidRequestError
from tokenmill.multimodal.prometheus import engine_multimodal_metrics
from tokenmill.multimodal.prompt import attach_media, chat_media
from tokenmill.outputs import RequestOutput
from tokenmill.pooling.offline import PoolingMixin
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, generation_defaults
from tokenmill.speech.offline import SpeechMixin
from tokenmill.threads import release_openmp_threads
from tokenmill.tokenizer.chat import with_tool_arguments
from tokenmill.vllm_compat import check_compat_options

logger = logging.getLogger(__name__)


class LLM(PoolingMixin, SpeechMixin):
    """A model loaded for offline generation (vLLM-compatible names).

    >>> llm = LLM()   # the embedded SmolLM2-135M-Instruct
    >>> llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0))
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """``options``: EngineConfig's fields; ``generation_config`` (auto, vllm or a
        folder: where default sampling parameters come from); vLLM's other engine options
        as ``tokenmill.vllm_compat`` documents them (a value that cannot be honoured, such
        as ``tensor_parallel_size=2``, raises ValueError)."""
        check_compat_options(options)
        self.generation_config: str = options.pop("generation_config", None) or "auto"
        known = {n for n, f in EngineConfig.__dataclass_fields__.items() if f.init}
        unknown = sorted(options.keys() - known)
        if unknown:
            raise TypeError(f"LLM() got unknown options {unknown}; known: {sorted(known)}")
        self.config = EngineConfig(model=model, **options)
        if self._load_pooling(self.config):  # an embedding / scoring model (pooling/)
            self.tokenizer, self._counter, self._server = self.engine.tokenizer, 0, None
            return
        if self._load_speech(self.config):  # a Whisper folder (speech/offline.py)
            self.engine, self.tokenizer, self._counter, self._server = None, None, 0, None
            return
        self.engine: LLMEngine | None = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.get_default_sampling_params()  # a bad generation_config fails here, not later
        self._counter = 0
        self._server = None  # the OpenAIServer while serve() runs
        # whichever thread generates next computes: this one keeps no idle OpenMP workers
        # (they would throttle another thread's; tokenmill.threads). Here again: one start.
        release_openmp_threads()

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Abort what is running and release the model. Safe to call twice.

        While ``serve()`` runs (in another thread), this drains the server first.
        """
        server = self._server
        if server is not None:
            server.close()
        self._close_speech()
        engine, self.engine = self.engine, None
        if engine is not None:
            for rid in engine.live_request_ids():
                engine.abort(rid)
            engine.shutdown()  # tensor-parallel workers exit

    shutdown = close

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live_engine(self) -> LLMEngine:
        if self.engine is None and self.transcriber is not None:
            raise InvalidRequestError(
                "this LLM holds a Whisper model: call transcribe(audio), or generate() with "
                '{"prompt": ..., "multi_modal_data": {"audio": (samples, rate)}}'
            )
        if self.engine is None:
            raise EngineDeadError("this LLM was closed; create a new one")
        return self.engine

    # -- info -------------------------------------------------------------------
    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name of the engine."""
        return self._live_engine()

    def get_tokenizer(self):
        """The Hugging Face tokenizer (``encode``, ``decode``, ``apply_chat_template``)."""
        return self.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from ``generation_config``: by default the checkpoint's
        generation_config.json."""
        gen = self._live_engine().loaded.checkpoint.generation_config
        return generation_defaults(self.generation_config, gen)

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (running requests keep theirs); returns how many."""
        return self._live_engine().reset_prefix_cache()

    def get_prefix_cache_metrics(self) -> dict[str, int | float]:
        """Cumulative prefix-cache counters: queries, hits, hit rate, matched and reused
        tokens, cached blocks now, evictions."""
        return self._live_engine().prefix_cache_metrics()

    def get_scheduling_metrics(self) -> dict[str, float | int]:
        """Counters of this engine: submitted, refused, completed, cancelled, failed
        requests, queue latency avg/max (seconds), and queued / running sequences now."""
        return self._live_engine().stats.scheduling_metrics()

    def get_multimodal_metrics(self) -> dict[str, float | int]:
        """Media counters: items processed, preprocessing seconds, encoder runs, encoder
        cache hits, encoder seconds, cache entries and bytes ({} for a text-only model)."""
        return engine_multimodal_metrics(self._live_engine())

    # -- serving ------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 8000, **server_options: Any) -> None:
        """Serve this model over the OpenAI-compatible HTTP API (what ``tokenmill serve``
        runs), reusing the loaded engine. Blocks until SIGINT/SIGTERM (or ``close()`` from
        another thread): then it drains (finishes accepted requests) and returns.

        ``server_options``: ``api_key``, ``max_queued_requests``, ``queue_timeout``,
        ``log_level`` (see ``tokenmill serve --help``).
        """
        from tokenmill.entrypoints.openai.launcher import OpenAIServer
        from tokenmill.entrypoints.openai.state import ServerConfig

        server = OpenAIServer(
            self._live_engine(), ServerConfig(host=host, port=port, **server_options)
        )
        self._server = server
        try:
            server.run()
        finally:
            self._server = None

    # -- generation -----------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids" and optionally "cache_salt", "reuse_context",
        "cache_generated_tokens" (prefix-cache controls). ``priority``: one int or
        one per prompt, lower runs first. ``use_tqdm``: a progress bar on stderr over
        the finished prompts (True, as in vLLM; or a tqdm-like class to use instead).
        A Whisper model takes audio prompts instead (``speech/offline.py``).
        """
        if self.transcriber is not None:
            return self._generate_speech(prompts, sampling_params)
        engine = self._live_engine()
        items = normalize_prompts(prompts, self.tokenizer)
        options = request_options(prompts, priority)
        items, options = attach_media(engine.mm_processor, self.config, prompts, items, options)
        params = params_per_prompt(sampling_params, len(items), self.get_default_sampling_params)
        ids = []
        with _driving(engine):
            try:
                for (text, token_ids), p, opts in zip(items, params, options):
                    p = p.clone()
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                    ids.append(
                        engine.add_request(
                            p.truncate_prompt(token_ids), p, self._next_id(), prompt=text,
                            options=opts,
                        )
                    )  # fmt: skip
                return self._run_to_completion(ids, use_tqdm)
            except BaseException:
                for rid in ids:
                    engine.abort(rid)
                raise

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate. Each output's
        ``prompt`` is the rendered conversation."""
        engine = self._live_engine()  # a closed LLM, or one holding Whisper, says so here
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            conv, media = chat_media(conv, self.config, engine.mm_processor)  # image parts
            ids = self.tokenizer.apply_chat_template(
                [with_tool_arguments(m) for m in conv],
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text, **media})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate_stream(
        self, prompt: PromptInput, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield outputs as tokens come (per ``sampling_params.output_kind``).

        Closing the iterator (or breaking out of a for loop over it) cancels the
        request and frees its KV blocks.
        """
        engine = self._live_engine()
        items, options = normalize_prompts(prompt, self.tokenizer)[:1], request_options(prompt)[:1]
        [(text, token_ids)], [opts] = attach_media(
            engine.mm_processor, self.config, prompt, items, options
        )
        params = sampling_params or self.get_default_sampling_params()
        request = (params.truncate_prompt(token_ids), params, self._next_id(), text, opts)
        return self._stream(engine, request, time.time())

    def _stream(self, engine: LLMEngine, request: tuple, arrival: float) -> Iterator[RequestOutput]:
        """The request's outputs as they come; the engine is held while the stream is
        open (``engine/drive.py``), from its first ``next``."""
        token_ids, params, rid, text, opts = request
        with _driving(engine):
            rid = engine.add_request(token_ids, params, rid, prompt=text, options=opts)
            yield from self._outputs(engine, rid, arrival)

    def _outputs(self, engine: LLMEngine, rid: str, arrival: float) -> Iterator[RequestOutput]:
        finished = False
        first_token: float | None = None
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        now = time.time()
                        if first_token is None and any(c.token_ids for c in out.outputs):
                            first_token = now
                        out.metrics.update(
                            _metrics(arrival, now if finished else None, first_token)
                        )
                        yield out
                if not engine.has_unfinished() and not finished:
                    break
        finally:
            if not finished:
                engine.abort(rid)

    def _run_to_completion(
        self, ids: list[str], use_tqdm: bool | Callable[..., Any] = False
    ) -> list[RequestOutput]:
        engine = self._live_engine()
        arrival = time.time()
        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = _progress_bar(use_tqdm, len(ids))
        try:
            while pending:
                if not engine.has_unfinished():
                    raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        out.metrics.update(_metrics(arrival, time.time()))
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]

    def _next_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int):
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts", unit="prompt")
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)


def _metrics(
    arrival: float, finished: float | None, first_token: float | None = None
) -> dict[str, float]:
    """``RequestOutput.metrics`` (wall-clock seconds since the epoch, as vLLM's): when the
    request was submitted, got its first token (streams only: a final-only output
    never sees it) and finished."""
    out = {"arrival_time": arrival}
    if first_token is not None:
        out["first_token_time"] = first_token
    if finished is not None:
        out["finished_time"] = finished
        out["e2e_latency"] = finished - arrival
    return out


def _driving(engine: Any) -> contextlib.AbstractContextManager[None]:
    """Hold the engine for an offline run (``engine/drive.py``); engines without a
    ``drive`` (the pooling engine: one driver only) need none."""
    drive = getattr(engine, "drive", None)
    if drive is None:
        return contextlib.nullcontext()
    return drive.offline(lambda: not engine.has_unfinished())
