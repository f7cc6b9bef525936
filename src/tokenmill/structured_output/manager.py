"""``StructuredOutputManager``: the engine's side of guided decoding.

1. ``validate`` (when a request is added): the guide is well formed, and the
   backend can build it (no tokenizer work, so it is fast). Bad input raises
   ``InvalidRequestError`` before anything is queued.
   Before that, ``GrammarLimits`` are checked in Python (``limits.py``): nothing over
   a limit reaches the native compiler.
2. ``submit``: the request's grammar compiles in a thread pool (cached by spec;
   requests with the same spec share one compile). Until it is ready the request
   waits here, not in the scheduler, so compiling never stalls the engine loop.
   The server calls ``precompile`` first (from its event loop), so that a grammar
   that fails to compile is a 400 before the request is queued.
3. ``collect``: requests whose grammar is ready go on to the scheduler; a compile
   that fails or runs past ``compile_timeout`` fails its requests.
4. Per step, ``prepare`` (before the model runs) starts filling one bitmask row per
   constrained row in a background thread; ``mask_logits`` (a sampler row processor)
   collects it and sets the disallowed logits to -inf.
5. ``advance`` feeds the sampled token to the matcher; a complete grammar ends
   the request.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from tokenmill.structured_output.backend import (
    CompiledGrammar,
    StructuredOutputBackend,
    create_backend,
)
from tokenmill.structured_output.bitmask import allocate_bitmask, apply_bitmask
from tokenmill.structured_output.compile_cache import (
    MIN_COST,
    TEXT_COST,
    CompilePool,
    GrammarCache,
    resident_bytes,
)
from tokenmill.structured_output.limits import GrammarLimitError, GrammarLimits, check_grammar
from tokenmill.structured_output.params import GrammarSpec, StructuredOutputsParams
from tokenmill.structured_output.state import StepResult, StructuredRequest
from tokenmill.threads import then_release

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.parsers.reasoning import ReasoningParser
    from tokenmill.sampling.sampler import SamplingRow
    from tokenmill.scheduler.output import SchedulerOutput
    from tokenmill.scheduler.request import Request

logger = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Validated specs remembered (by digest), so a repeated guide is not validated again."""


class StructuredOutputManager:
    def __init__(
        self,
        backend_name: str,
        tokenizer,
        vocab_size: int,
        reasoning_parser: type[ReasoningParser] | None = None,
        compile_threads: int = 2,
        limits: GrammarLimits | None = None,
    ) -> None:
        self.backend_name = backend_name
        self.reasoning_parser = reasoning_parser
        """Splits reasoning from the answer; the grammar constrains only the answer."""
        self.markers = reasoning_parser.markers(tokenizer) if reasoning_parser else None
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self.limits = limits or GrammarLimits()
        """Bounds on every request's grammar (the server sets them from its flags)."""
        self._pool = CompilePool(compile_threads)
        self._cache: GrammarCache[CompiledGrammar] = GrammarCache(self.limits.cache_bytes)
        self._validated: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # _validated; the cache has its own
        self._waiting: dict[str, tuple[Request, Future[CompiledGrammar], float]] = {}
        self._mask_thread: ThreadPoolExecutor | None = None
        self._prepared: tuple[list[StructuredRequest], Future[torch.Tensor]] | None = None

    @classmethod
    def from_config(
        cls, config: EngineConfig, tokenizer, vocab_size: int
    ) -> StructuredOutputManager:
        from tokenmill.parsers.reasoning import resolve_reasoning_parser

        parser = resolve_reasoning_parser(config.reasoning_parser, tokenizer.chat_template)
        return cls(config.structured_outputs_backend, tokenizer, vocab_size, parser)

    @property
    def backend(self) -> StructuredOutputBackend:
        """Created on first use (building the tokenizer's token trie takes about a second)."""
        with self._backend_lock:
            if self._backend is None:
                tok = self._tokenizer
                self._backend = create_backend(
                    self.backend_name,
                    tok.hf,
                    self._vocab_size,
                    sorted(tok.eos_token_ids),
                    self.limits,
                )
            return self._backend

    def set_limits(self, limits: GrammarLimits) -> None:
        """New bounds (before the first request: the backend is built with them)."""
        self.limits = limits
        self._cache.max_bytes = limits.cache_bytes
        with self._backend_lock:
            self._backend = None

    # -- adding requests -------------------------------------------------------------
    def validate(self, guide: StructuredOutputsParams) -> GrammarSpec:
        """The guide's spec; raises InvalidRequestError naming what is wrong with it.

        The limits first (Python only), then the backend's own check, which runs on a
        compile thread (a big native stack), waited for here."""
        spec = guide.spec()
        key = _digest(spec)
        with self._lock:
            known = key in self._validated or spec in self._cache
        if not known:
            check_grammar(spec, self.limits)
            future = self._pool.submit(self.backend.validate, spec)
            try:
                future.result(self.limits.compile_timeout)
            except TimeoutError as e:
                raise self.compile_timeout_error() from e
            with self._lock:
                self._remember(self._validated, key, None)
        return spec

    def precompile(self, guide: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """Check the limits and start (or find) the guide's compile; thread-safe.

        For callers outside the engine thread that want a compile error before they
        add the request (the server: a 400 instead of a failed stream)."""
        spec = guide.spec()
        if spec not in self._cache:
            check_grammar(spec, self.limits)
        return self._compiled(spec)

    def submit(self, req: Request, spec: GrammarSpec) -> bool:
        """Attach the request's state and start its compile; True if it is ready now."""
        req.structured = StructuredRequest.start(spec, self.markers, req.prompt_token_ids)
        future = self._compiled(spec)
        if future.done() and future.exception() is None:
            req.structured.matcher = future.result().matcher()
            return True
        self._waiting[req.request_id] = (req, future, time.monotonic())
        return False

    def _compiled(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        holder: list[Future[CompiledGrammar]] = []

        def start() -> Future[CompiledGrammar]:
            holder.append(self._pool.submit(self._compile, spec))
            return holder[0]

        future = self._cache.get_or_start(spec, start)
        if holder:  # a new compile: its size is known when it finishes
            future.add_done_callback(lambda f: self._account(spec, f))
        return future

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        before = resident_bytes()
        grammar = self.backend.compile(spec)
        cost = max(resident_bytes() - before, TEXT_COST * len(spec.text), MIN_COST)
        grammar.cost_bytes = cost
        return grammar

    def _account(self, spec: GrammarSpec, future: Future[CompiledGrammar]) -> None:
        cost = MIN_COST
        if future.exception() is None:
            cost = future.result().cost_bytes
        self._cache.set_cost(spec, future, cost)

    @property
    def cache_bytes(self) -> int:
        """Estimated memory of the compiled grammars kept (at most ``limits.cache_bytes``,
        plus the newest one)."""
        return self._cache.num_bytes

    def compile_timeout_error(self) -> GrammarLimitError:
        return GrammarLimitError(
            f"the grammar did not compile within {self.limits.compile_timeout:g} s "
            "(compile_timeout; server flag --grammar-compile-timeout)"
        )

    @staticmethod
    def _remember(cache: OrderedDict, key, value) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)

    # -- waiting for compiles ----------------------------------------------------------
    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def collect(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose compile finished: (ready ones, (failed one, error message))."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        for rid, (req, future, since) in list(self._waiting.items()):
            if not future.done():
                if now - since > self.limits.compile_timeout:
                    del self._waiting[rid]
                    failed.append((req, str(self.compile_timeout_error())))
                continue
            del self._waiting[rid]
            error = future.exception()
            if error is None:
                assert req.structured is not None
                req.structured.matcher = future.result().matcher()
                ready.append(req)
            else:
                failed.append((req, f"{type(error).__name__}: {error}"))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or ``timeout`` seconds pass (an idle engine)."""
        if self._waiting:
            wait([f for _, f, _ in self._waiting.values()], timeout, return_when="FIRST_COMPLETED")

    def discard(self, request_id: str) -> Request | None:
        """Forget a waiting request (aborted before its grammar was ready)."""
        entry = self._waiting.pop(request_id, None)
        return entry[0] if entry else None

    # -- every step ----------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> None:
        """Start filling this step's bitmask in the background (llguidance releases the GIL),
        so that it overlaps the model's forward pass; ``mask_logits`` collects it. A
        sequence with drafts has a row per draft and one after them (``_fill``)."""
        c = sched.cols
        tasks = [
            (req.structured, c.drafts.get(i, ()))
            for i, (req, samples) in enumerate(zip(c.requests, c.samples))
            if samples and req.structured is not None and req.structured.masks
        ]
        self._prepared = None
        if tasks:
            if self._mask_thread is None:
                self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-mask")
            rows = [state for state, drafts in tasks for _ in range(len(drafts) + 1)]
            # then_release: this helper's OpenMP workers (a parallel fill starts them) would
            # stop the engine thread's workers spin-waiting for the life of the process
            fill = self._mask_thread.submit(then_release, self._fill_tasks, tasks)
            self._prepared = (rows, fill)

    def _fill_tasks(self, tasks: list[tuple[StructuredRequest, tuple[int, ...]]]) -> torch.Tensor:
        """The step's bitmask: one row per sequence without drafts (in one parallel fill),
        drafts + 1 rows for one with drafts (its matcher walked through them)."""
        if all(not drafts for _, drafts in tasks):
            return self._fill([state for state, _ in tasks])
        backend = self.backend
        bitmask = allocate_bitmask(sum(len(d) + 1 for _, d in tasks), backend.bitmask_width)

        def fill(matcher, row: int) -> None:
            backend.fill_bitmasks([(matcher, row)], bitmask)

        row = 0
        for state, drafts in tasks:
            state.fill_draft_masks(drafts, fill, row)
            extra = state.extra_allowed
            if extra is not None:
                bitmask[row, extra // 32] |= _bit(extra % 32)
            row += len(drafts) + 1
        return bitmask

    def _fill(self, states: list[StructuredRequest]) -> torch.Tensor:
        """[len(states), W] int32: row j = what states[j] allows next."""
        backend = self.backend
        bitmask = allocate_bitmask(len(states), backend.bitmask_width)
        backend.fill_bitmasks([(state.matcher, j) for j, state in enumerate(states)], bitmask)
        for j, state in enumerate(states):
            extra = state.extra_allowed
            if extra is not None:
                bitmask[j, extra // 32] |= _bit(extra % 32)
        return bitmask

    def mask_logits(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], only: Sequence[int] | None = None
    ) -> None:
        """Sampler row processor: -inf on the tokens each constrained row may not take
        (``only``: the rows with a grammar, see ``row_processor``)."""
        constrained = [
            (i, state)
            for i in (range(len(rows)) if only is None else only)
            if (state := rows[i].structured) is not None and state.masks
        ]
        prepared, self._prepared = self._prepared, None
        if not constrained:
            return
        states = [state for _, state in constrained]
        if (
            prepared is not None
            and len(prepared[0]) == len(states)
            and all(a is b for a, b in zip(prepared[0], states))
        ):
            bitmask = prepared[1].result()
        else:  # not prepared (a sampler used on its own): fill now
            bitmask = self._fill(states)
        index = None
        if len(constrained) < len(rows):
            index = torch.tensor([i for i, _ in constrained], dtype=torch.int64)
        apply_bitmask(logits, bitmask, index)

    def advance(self, req: Request, end: int | None = None) -> StepResult:
        """Feed the request's output token ``end - 1`` (default: the newest) to its matcher."""
        assert req.structured is not None
        outputs = req.output_token_ids if end is None else req.output_token_ids[:end]
        result = req.structured.advance(outputs)
        if result is StepResult.REJECTED:
            logger.warning("request %s: the grammar rejected token %d", req.request_id, outputs[-1])
        return result

    def shutdown(self) -> None:
        self._pool.shutdown()
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=False, cancel_futures=True)


def _digest(spec: GrammarSpec) -> bytes:
    text = (
        repr((spec.kind, spec.any_whitespace, spec.additional_properties, spec.whitespace_pattern))
        + spec.text
    )
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a Python int that fits in int32."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k
