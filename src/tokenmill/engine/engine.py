"""The engine loop: add requests, step, get outputs. One owner, one thread."""

from __future__ import annotations

import logging
import uuid

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.loading import LoadedModel, kv_cache_blocks, load_model
from tokenmill.engine.output_processor import OutputProcessor, ParentState
from tokenmill.engine.request import RequestOptions
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.engine.validation import check_params, check_prompt, resolve_max_tokens
from tokenmill.errors import InvalidRequestError
from tokenmill.kv_cache import KVCacheManager
from tokenmill.metrics.stats import EngineStats
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling import Sampler, make_generator
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.state import StepResult
from tokenmill.threads import configure_threads
from tokenmill.worker.model_runner import LaunchedStep, allocate_kv_caches, make_runner

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        configure_threads()  # before loading: repacking quantized weights uses the pool
        self.loaded = loaded or load_model(config)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self.loaded.max_model_len
        num_blocks = kv_cache_blocks(config, self.loaded)
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            max_blocks_per_seq=-(-self.max_model_len // config.block_size),
        )  # fmt: skip
        budget = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, budget, self.max_model_len, config.long_prefill_token_threshold
            ),
            self.kv,
        )
        caches = allocate_kv_caches(
            self.loaded.model, num_blocks, config.block_size, self.loaded.dtype, self.loaded.device
        )
        generator = torch.Generator(device=self.loaded.device).manual_seed(config.seed)
        self.structured = StructuredOutputManager.from_config(config, self.tokenizer, self.vocab_size)
        sampler = Sampler(generator, extra_processors=(self.structured.mask_logits,))
        self.runner = make_runner(
            config, self.loaded.model, caches, self.loaded.device, sampler, self.max_model_len
        )
        self.processor = OutputProcessor(self.tokenizer)
        self.overlap = config.overlaps_steps()
        """Asynchronous scheduling: launch step N+1 before waiting for step N."""
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._sync_only: set[str] = set()
        """Live requests whose sampling reads their tokens so far: steps wait meanwhile."""
        self._children: dict[str, list[str]] = {}
        self._parent_of: dict[str, str] = {}
        self.stats = EngineStats()
        logger.info("KV cache: %d blocks x %d tokens", num_blocks, config.block_size)

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
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        check_params(params, self.vocab_size, self.config.max_logprobs)
        max_tokens = resolve_max_tokens(params, len(prompt_token_ids), self.max_model_len)
        guide = params.structured_outputs
        spec = self.structured.validate(guide) if guide is not None else None
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
        self.processor.add(parent, [c.request_id for c in children], children)
        if params.reads_output_tokens:
            self._sync_only.update(c.request_id for c in children)
        self._children[request_id] = [c.request_id for c in children]
        self._parent_of.update((c.request_id, request_id) for c in children)
        for child in children:  # a child whose grammar still compiles waits in self.structured
            if spec is None or self.structured.submit(child, spec):
                self.scheduler.add(child)
        self.stats.on_added(request_id, children)
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
        for cid in list(self._children.get(request_id, [])):
            req = self.scheduler.finish(cid, RequestStatus.FINISHED_ABORTED)
            if req is None and (req := self.structured.discard(cid)) is not None:
                req.status = RequestStatus.FINISHED_ABORTED
            if req is not None:
                out = self.processor.finish(req) or out
                self._forget(cid)
        return out

    def has_unfinished(self) -> bool:
        """Whether a live request waits for steps. (A step in flight whose requests have
        all ended, say aborted, carries nothing: the next step collects and drops it.)"""
        return self.scheduler.has_unfinished() or self.structured.has_waiting

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (running requests keep theirs). Returns how many."""
        return self.scheduler.reset_prefix_cache()

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
        }

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step that finished.

        Synchronously that is this step. With ``overlap`` the step is launched first and
        the previous one (in flight since the last call) is waited for and processed while
        this one runs on the device; its requests' next tokens are taken from the device.
        """
        outputs = self._admit_compiled()
        overlap = self.overlap and not self._sync_only
        if not overlap:
            outputs += self._collect()  # the scheduler must see the last tokens first
        sched = self.scheduler.schedule()
        if sched.is_empty:
            outputs += self._collect()
            if not outputs:
                self.structured.wait(timeout=0.05)  # idle but for compiles: wait for one
            return outputs
        self.stats.on_scheduled(sched)
        self.structured.prepare(sched)  # grammar masks compute while the model runs
        try:
            launched = self.runner.launch(sched)
        except Exception as exc:  # a broken step fails its requests, not the engine
            logger.exception("model step failed")
            outputs += self._collect()
            return outputs + self._fail([s.request for s in sched.seqs], f"{type(exc).__name__}: {exc}")
        outputs += self._collect()
        self._in_flight = (sched, launched)
        if not overlap or not self.scheduler.has_unfinished():  # nobody waits for it: drain
            outputs += self._collect()
        return outputs

    def _collect(self) -> list[RequestOutput]:
        """Wait for the step in flight, if any, and turn its tokens into outputs."""
        if self._in_flight is None:
            return []
        sched, launched = self._in_flight
        self._in_flight = None
        try:
            result = self.runner.collect(launched)
        except Exception as exc:
            logger.exception("model step failed")
            return self._fail([s.request for s in sched.seqs], f"{type(exc).__name__}: {exc}")
        for rid, (start, entries) in result.prompt_logprobs.items():
            self.processor.record_prompt_logprobs(rid, start, entries)
        outputs: list[RequestOutput] = []
        progressed = self.scheduler.update(sched, result.sampled)
        self.stats.on_tokens(progressed)
        logprobs = result.logprobs
        for req in progressed:
            stop = self.processor.process_token(req, logprobs.get(req.request_id) if logprobs else None)
            if stop is not None and not req.is_finished:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            error = self._advance_grammar(req) if req.structured is not None else None
            if req.is_finished:
                self._log_reuse(req)
                out = self.processor.finish(req, error)
                self._forget(req.request_id)
            else:
                out = self.processor.progress(req)
            if out is not None:
                outputs.append(out)
        if self.config.check_kv_integrity:
            self.kv.check_integrity()
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar compiled; fail those whose compile failed."""
        ready, failed = self.structured.collect()
        for req in ready:
            self.scheduler.add(req)
        outputs = []
        for req, message in failed:
            req.status = RequestStatus.FINISHED_ERROR
            out = self.processor.finish(req, error=message)
            self._forget(req.request_id)
            if out is not None:
                outputs.append(out)
        return outputs

    def _advance_grammar(self, req: Request) -> str | None:
        """Feed the new token to the request's grammar: a complete grammar stops the request
        (also one that reached max_tokens with it: it is complete, not truncated)."""
        if req.status is RequestStatus.FINISHED_STOPPED:  # EOS or a stop string
            return None
        result = self.structured.advance(req)
        if result is StepResult.COMPLETE:
            if not req.is_finished:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            elif req.status is RequestStatus.FINISHED_LENGTH:
                req.status = RequestStatus.FINISHED_STOPPED
        elif result is StepResult.REJECTED:
            if not req.is_finished:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR)
            return f"the grammar rejected token {req.output_token_ids[-1]}"
        return None

    def _log_reuse(self, req: Request) -> None:
        if self.kv.enable_prefix_caching and logger.isEnabledFor(logging.INFO):
            logger.info(
                "request %s: %d of %d prompt tokens from the prefix cache",
                req.request_id, req.num_cached_tokens, req.num_prompt_tokens,
            )

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        outputs = []
        for req in requests:
            if req.is_finished:  # ended by the step before (async scheduling)
                continue
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR)
            out = self.processor.finish(req, error=message)
            self._forget(req.request_id)
            if out is not None:
                outputs.append(out)
        return outputs

    def _forget(self, child_id: str) -> None:
        """Drop the parent entry once none of its children is live."""
        self.stats.on_finished(child_id)
        self._sync_only.discard(child_id)
        parent_id = self._parent_of.pop(child_id)
        kids = self._children[parent_id]
        if all(k not in self._parent_of for k in kids):
            del self._children[parent_id]
