"""The engine loop: add requests, step, get outputs. One owner, one thread.

``builder.build_engine`` assembles the parts; this loop schedules a step, hands it to the
step pipeline (which owns the step in flight) and applies finished steps' tokens:
scheduler update, request hooks, grammar, then outputs.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

from tokenmill.config import EngineConfig
from tokenmill.engine.builder import build_engine
from tokenmill.engine.drive import DriveLock
from tokenmill.engine.hooks import RequestHook
from tokenmill.engine.loading import LoadedModel
from tokenmill.engine.output_processor import OutputProcessor, ParentState
from tokenmill.engine.pipeline import StepPipeline, StepResult
from tokenmill.engine.request import RequestOptions
from tokenmill.engine.validation import check_params, check_prompt, resolve_max_tokens
from tokenmill.errors import InvalidRequestError
from tokenmill.executor import UniProcExecutor
from tokenmill.metrics.stats import EngineStats
from tokenmill.multimodal.prompt import build_processor, encoder_budget, multimodal_metrics
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling import make_generator
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import SchedulerOutput
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.spec_decode.proposer import DraftHook
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        hooks: Sequence[RequestHook] = (),
    ) -> None:
        self.config = config
        self.drive = DriveLock()
        """One driver at a time: the offline API or a server's engine thread (``drive.py``)."""
        parts = build_engine(config, loaded, hooks)
        self.loaded = parts.loaded
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self.loaded.max_model_len
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.structured = parts.structured
        self.executor = parts.executor
        self.pipeline = StepPipeline(parts.executor)
        self.hooks = parts.hooks
        self.startup_phases = parts.startup
        """Seconds per start-up phase (``/metrics``: ``tokenmill:startup_phase_seconds``)."""
        """Request hooks, called in order (``engine/hooks.py``): structured output, then
        the caller's."""
        self._draft_hook = next((h for h in self.hooks if isinstance(h, DraftHook)), None)
        """Speculative decoding's hook (``spec_decode/``), None when off."""
        self.stats = EngineStats(
            spec_decode=self._draft_hook.stats if self._draft_hook is not None else None
        )
        """Folded from the stages' event records (``metrics/stats.py``)."""
        self.processor = OutputProcessor(self.tokenizer, self.stats.on_request_finished)
        self.overlap = config.overlaps_steps()
        """Asynchronous scheduling: launch step N+1 before waiting for step N."""
        self.mm_processor = build_processor(
            config, self.loaded.model, self.loaded.checkpoint.path, self.tokenizer
        )
        """Media -> placeholder runs at the boundary (``multimodal/``); None: text only."""
        if self.mm_processor is not None:
            self.scheduler.encoder_budget = encoder_budget(config, self.scheduler.config)

    def shutdown(self) -> None:
        """Release the executor's workers (tensor / pipeline ranks); idempotent."""
        self.executor.shutdown()

    @property
    def runner(self) -> ModelRunner:
        """The in-process executor's model runner (tests swap it)."""
        assert isinstance(self.executor, UniProcExecutor), "the runner lives in a worker"
        return self.executor.runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        assert isinstance(self.executor, UniProcExecutor), "the runner lives in a worker"
        self.executor.runner = runner

    @property
    def vocab_size(self) -> int:
        return self.loaded.model.vocab_size

    # -- requests ---------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        options: RequestOptions | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input."""
        request_id = request_id or uuid.uuid4().hex
        if self.processor.has_parent(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_token_ids = params.truncate_prompt(prompt_token_ids)  # idempotent: LLM did too
        check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        check_params(params, self.vocab_size, self.config.max_logprobs)
        params.resolve_bad_words(self.tokenizer, self.vocab_size)
        max_tokens = resolve_max_tokens(params, len(prompt_token_ids), self.max_model_len)
        contexts = [hook.check(params) for hook in self.hooks]
        options = options or RequestOptions()
        children = [
            self._child(prompt_token_ids, params, max_tokens, request_id, i, options)
            for i in range(params.n)
        ]
        parent = ParentState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            kind=params.output_kind,
            completions=[CompletionOutput(i, "", []) for i in range(params.n)],
        )
        self.processor.add(parent, children)
        for child in children:  # a child a hook holds (its grammar compiles) waits there
            held = [not hook.on_add(child, ctx) for hook, ctx in zip(self.hooks, contexts)]
            child.token_hooks = tuple(hook for hook in self.hooks if hook.watches(child))
            if not any(held):
                self.scheduler.add(child)
        self.stats.on_added()
        self._update_gauges()
        return request_id

    def _child(self, prompt_ids, params, max_tokens, parent_id, index, options) -> Request:
        """n > 1 fans out into n requests; child i gets seed + i so they differ."""
        child_id = parent_id
        if params.n > 1:
            child_id = f"{index}_{parent_id}"
            params = params.clone()
            params.seed = None if params.seed is None else params.seed + index
            params.n = 1
        req = Request(child_id, list(prompt_ids), params, max_tokens, self.tokenizer.eos_token_ids)
        options.apply(req)
        if params.seed is not None:
            req.generator = make_generator(params.seed, self.loaded.device)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (and its n children); its KV blocks are free on return."""
        out = None
        for cid in list(self.processor.child_ids(request_id)):
            req = self.scheduler.finish(cid, RequestStatus.FINISHED_ABORTED)
            for hook in self.hooks:
                if req is None and (req := hook.discard(cid)) is not None:
                    req.status = RequestStatus.FINISHED_ABORTED
            if req is not None:
                out = self._finish(req) or out
        self._update_gauges()
        return out

    def is_started(self, request_id: str) -> bool:
        """Whether a sequence of the live user request was scheduled (False once over)."""
        parent = self.processor.parent(request_id)
        return parent is not None and parent.started

    def mark_timed_out(self, request_id: str) -> None:
        """The request is about to be aborted for waiting too long: counted as refused."""
        parent = self.processor.parent(request_id)
        if parent is not None:
            parent.timed_out = True

    def _update_gauges(self) -> None:
        running = len(self.scheduler.running)
        self.stats.set_gauges(len(self.processor.children) - running, running)

    def live_request_ids(self) -> list[str]:
        """The user requests (not their n sequences) that have not finished."""
        return self.processor.live_parent_ids()

    def has_unfinished(self) -> bool:
        """Whether a live request waits for steps. (A step in flight whose requests have
        all ended, say aborted, carries nothing: the next step collects and drops it.)"""
        return self.scheduler.has_unfinished() or any(hook.has_held for hook in self.hooks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (running requests keep theirs). Returns how many."""
        return self.scheduler.reset_prefix_cache()

    def encoder_metrics(self) -> dict[str, float | int]:
        """The media encoder's counters ({} without one; a runner in a worker rank keeps
        its own): ``multimodal_metrics`` without the processor's."""
        runner = getattr(self.executor, "runner", None)
        return multimodal_metrics(None, getattr(runner, "mm", None))

    def prefix_cache_metrics(self) -> dict[str, int | float]:
        stats, pool = self.kv.stats, self.kv.pool
        return {
            "prefix_cache_queries": stats.queries,
            "prefix_cache_hits": stats.hits,
            "prefix_cache_hit_rate": stats.hits / stats.queries if stats.queries else 0.0,
            "prefix_cache_matched_tokens": stats.matched_tokens,
            "prefix_cache_reused_tokens": stats.reused_tokens,
            "prefix_cache_cached_blocks": pool.num_cached,
            "prefix_cache_evictions": pool.num_evictions,
            **self.kv.state_cache_metrics(),  # recurrent-state snapshots; {} without
        }

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the steps that finished.

        Synchronously that is this step. With ``overlap`` the step is launched first and
        the previous one (in flight since the last call) is waited for and applied while
        this one runs on the device; its requests' next tokens are taken from the device.
        A live request whose sampling reads its tokens so far (penalties, min_tokens, a
        grammar) needs them on the host before it is scheduled: steps then do not overlap.
        """
        outputs = self._admit_ready()
        overlap = self.overlap and not self.scheduler.num_sync_only
        if overlap and self._draft_hook is not None and self._draft_hook.needs_tokens:
            overlap = False  # drafts follow known tokens: this step waits for the last
        if not overlap:
            outputs += self._apply(self.pipeline.drain())
        for hook in self.hooks:
            hook.before_step(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            outputs += self._apply(self.pipeline.drain())
            if not outputs:
                for hook in self.hooks:  # idle but for held requests: wait for one
                    hook.wait(timeout=0.05)
            self._update_gauges()
            return outputs
        self._note_scheduled(sched)
        for hook in self.hooks:
            hook.on_scheduled(sched)
        # Nobody waits for it: drain. Nor is a step with drafts kept in flight: its
        # requests could not be scheduled again until it returns (how many tokens it
        # yields is unknown), so they would skip every other step.
        keep = overlap and self.scheduler.has_unfinished()
        if keep and self._draft_hook is not None:
            keep = not sched.has_drafts
        outputs += self._apply(self.pipeline.launch(sched, keep_in_flight=keep))
        self._update_gauges()
        return outputs

    def _note_scheduled(self, sched: SchedulerOutput) -> None:
        """Metrics of the step's event records: first schedules start their request."""
        self.stats.on_scheduled(sched)
        now = time.monotonic()
        for req in sched.first_scheduled:
            parent = self.processor.parent(req.request_id)
            if parent is not None and not parent.started:
                parent.started = True
                self.stats.on_started(parent.arrival, now)

    def _apply(self, results: list[StepResult]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for result in results:
            if result.output is None:
                outputs += self._fail(list(result.sched.cols.requests), result.error or "")
            else:
                outputs += self._apply_tokens(result)
        if results and self.config.check_kv_integrity:
            self.kv.check_integrity()
        return outputs

    def _apply_tokens(self, result: StepResult) -> list[RequestOutput]:
        """A finished step's tokens -> scheduler, hooks, grammars, outputs."""
        out = result.output
        assert out is not None
        for rid, (start, entries) in out.prompt_logprobs.items():
            self.processor.record_prompt_logprobs(rid, start, entries)
        row_of = (
            {r.request_id: i for i, r in enumerate(result.sched.cols.requests)}
            if (out.logprobs is not None)
            else None
        )
        outputs: list[RequestOutput] = []
        progressed = self.scheduler.update(result.sched, out.tokens)
        processor = self.processor
        counts = progressed.counts
        for k, (req, num_new) in enumerate(zip(progressed.requests, counts)):
            logprobs = None
            if out.logprobs is not None and row_of is not None:
                logprobs = out.logprobs[row_of[req.request_id]]
            stop, consumed = processor.process_tokens(req, num_new, logprobs)
            if stop is not None:
                req.truncate_output(req.num_output_tokens - num_new + consumed)
                num_new = consumed
                counts[k] = num_new
                if not req.is_finished:
                    self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            error = self._run_after_tokens(req, num_new) if req.token_hooks else None
            if req.is_finished:
                self._log_reuse(req)
                emitted = self._finish(req, error)
            else:
                emitted = processor.progress(req)
            if emitted is not None:
                outputs.append(emitted)
        self.stats.on_tokens(progressed, time.monotonic())
        return outputs

    def _admit_ready(self) -> list[RequestOutput]:
        """Schedule the requests hooks held that may run now; fail those that failed."""
        outputs = []
        for hook in self.hooks:
            ready, failed = hook.ready()
            for req in ready:
                self.scheduler.add(req)
            for req, message in failed:
                req.status = RequestStatus.FINISHED_ERROR
                out = self._finish(req, message)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _run_after_tokens(self, req: Request, num_new: int) -> str | None:
        """Hooks see the new tokens; one may end the request (the first error wins)."""
        error = None
        for hook in req.token_hooks:
            outcome = hook.after_tokens(req, num_new)
            if outcome is None:
                continue
            if not req.is_finished:
                self.scheduler.finish(req.request_id, outcome.status)
            elif (outcome.status is RequestStatus.FINISHED_STOPPED
                  and req.status is RequestStatus.FINISHED_LENGTH):  # fmt: skip
                req.status = RequestStatus.FINISHED_STOPPED  # complete at max_tokens
            error = error or outcome.error
        return error

    def _log_reuse(self, req: Request) -> None:
        if self.kv.enable_prefix_caching and logger.isEnabledFor(logging.INFO):
            logger.info(
                "request %s: %d of %d prompt tokens from the prefix cache",
                req.request_id,
                req.num_cached_tokens,
                req.num_prompt_tokens,
            )

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        outputs = []
        for req in requests:
            if req.is_finished:  # ended by the step before (async scheduling)
                continue
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR)
            out = self._finish(req, message)
            if out is not None:
                outputs.append(out)
        return outputs

    def _finish(self, req: Request, error: str | None = None) -> RequestOutput | None:
        """A sequence ended (its blocks are free): hooks, metrics, then its output."""
        for hook in self.hooks:
            hook.on_finish(req)
        return self.processor.finish(req, error)
