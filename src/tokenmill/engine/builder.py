"""Assembles an engine: model, KV cache, scheduler, runner, executor. ``LLMEngine`` loops.

Everything that happens once per engine lives here (loading, KV sizing and allocation,
CUDA-graph capture, the process-wide thread setting); the loop in ``engine.py`` only
steps what this built.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.bundles.phases import Phases
from tokenmill.config import EngineConfig
from tokenmill.engine.hooks import RequestHook
from tokenmill.engine.loading import LoadedModel, kv_cache_blocks, load_model
from tokenmill.executor import Executor, UniProcExecutor
from tokenmill.host_memory import keep_freed_memory
from tokenmill.kv_cache import KVCacheCoordinator, KVCacheManager, make_kv_cache
from tokenmill.kv_cache.coordinator import state_pool_slots
from tokenmill.kv_cache.snapshot_copies import SnapshotTensors
from tokenmill.kv_cache.snapshots import snapshot_rows
from tokenmill.sampling import Sampler
from tokenmill.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.interleave import StepInterleave
from tokenmill.spec_decode import DraftHook
from tokenmill.spec_decode.config import check_target_cache
from tokenmill.spec_decode.registry import TargetParts, build_draft_hook
from tokenmill.structured_output.hook import StructuredOutputHook
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.threads import configure_threads
from tokenmill.worker.model_runner import ModelRunner, allocate_kv_caches, make_runner

if TYPE_CHECKING:
    from tokenmill.distributed.launch import Ranks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    """What one engine runs on; each part has one owner afterwards (the loop)."""

    loaded: LoadedModel
    kv: KVCacheManager | KVCacheCoordinator
    scheduler: Scheduler
    structured: StructuredOutputManager
    hooks: tuple[RequestHook, ...]
    """Structured output's hook first, then the caller's (a proposer...), then the draft
    hook of ``config.speculative`` unless the caller passed one."""
    runner: ModelRunner
    executor: Executor
    startup: dict[str, float]
    """Seconds per start-up phase: the load's (``LoadedModel.phases``), then kv cache and
    runner (on CUDA the decode-graph capture)."""


def build_engine(
    config: EngineConfig, loaded: LoadedModel | None = None, hooks: Sequence[RequestHook] = ()
) -> EngineParts:
    configure_threads()  # before loading: repacking quantized weights uses the pool
    keep_freed_memory()
    ranks = _start_ranks(config, loaded)  # tensor parallel: the workers load meanwhile
    try:
        return _assemble(config, loaded, hooks, ranks)
    except BaseException:
        if ranks is not None:  # workers would wait for a driver that is gone
            ranks.stop(kill=True)
        raise


def _assemble(
    config: EngineConfig,
    loaded: LoadedModel | None,
    hooks: Sequence[RequestHook],
    ranks: Ranks | None,
) -> EngineParts:
    loaded = loaded or load_model(config, None if ranks is None else ranks.shard)
    num_blocks = kv_cache_blocks(config, loaded)
    specs = loaded.model.cache_specs()
    check_target_cache(config.speculative, specs)  # what a recurrent state can verify
    num_slots = state_pool_slots(
        specs, num_blocks, config.block_size, config.max_num_seqs,
        config.ssm_state_cache_size, config.ssm_full_memory_ratio,
    )  # fmt: skip
    budget_bytes = config.context_cache.recurrent_snapshot_pool_bytes
    rows = snapshot_rows(specs, config.block_size, budget_bytes, num_slots)
    kv = make_kv_cache(  # the manager itself unless some layer needs state slots
        specs, num_blocks, config.block_size, config.enable_prefix_caching,
        max_blocks_per_seq=-(-loaded.max_model_len // config.block_size),
        num_slots=num_slots, snapshot_rows=rows,
    )  # fmt: skip
    budget = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
    scheduler = Scheduler(
        SchedulerConfig(
            config.max_num_seqs, budget, loaded.max_model_len, config.long_prefill_token_threshold
        ),
        kv,
    )
    if ranks is not None:  # the workers allocate the same blocks; the model broadcasts
        pool = kv.snapshots if isinstance(kv, KVCacheCoordinator) else None
        loaded = ranks.drive(loaded, num_blocks, num_slots, 0 if pool is None else pool.num_rows)
    phases = Phases(loaded.phases)
    with phases("kv cache"):
        caches = allocate_kv_caches(
            loaded.model, num_blocks, config.block_size, loaded.dtype, loaded.device,
            num_slots=num_slots,
        )  # fmt: skip
    generator = torch.Generator(device=loaded.device).manual_seed(config.seed)
    structured = StructuredOutputManager.from_config(
        config, loaded.tokenizer, loaded.model.vocab_size
    )
    all_hooks = (StructuredOutputHook(structured), *hooks)
    processors = tuple(h.logits_processor for h in all_hooks if h.logits_processor is not None)
    sampler = Sampler(generator, extra_processors=processors)
    state_slot = kv.state_slot if isinstance(kv, KVCacheCoordinator) else None
    state_step, snapshots = None, None
    if isinstance(kv, KVCacheCoordinator) and kv.snapshots is not None:
        state_step = kv.state_step
        snapshots = SnapshotTensors(loaded.model.cache_specs(), caches, kv.snapshots.num_rows)
    with phases("runner"):
        runner = make_runner(
            config, loaded.model, caches, loaded.device, sampler, loaded.max_model_len,
            state_slot, state_step, snapshots,
        )  # fmt: skip
    logger.info("KV cache: %d blocks x %d tokens", num_blocks, config.block_size)
    if isinstance(kv, KVCacheCoordinator):
        logger.info("state cache: %d slots, %d snapshot rows", num_slots, rows)
    if config.speculative is not None and not any(isinstance(h, DraftHook) for h in hooks):
        target = TargetParts(config, loaded, runner, kv)
        all_hooks = (*all_hooks, build_draft_hook(config.speculative, target, budget))
    phases.log("engine ready")
    executor = _executor(config, runner, ranks)
    if executor.interleaves:  # pipeline stages overlap: steps take turns over sequences
        scheduler.interleave = StepInterleave()
    return EngineParts(
        loaded, kv, scheduler, structured, all_hooks, runner, executor, phases.seconds
    )


def _start_ranks(config: EngineConfig, loaded: LoadedModel | None) -> Ranks | None:
    """Tensor parallelism's worker processes and process group; None on one device."""
    if config.parallel.data_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size={config.parallel.data_parallel_size} runs replicas behind "
            "a server (tokenmill serve --data-parallel-size N); one engine has one replica"
        )
    if config.parallel.world_size == 1:
        return None
    if loaded is not None:
        raise ValueError("a loaded model can not be tensor-parallel: each rank loads its shard")
    from tokenmill.distributed.launch import start_ranks

    return start_ranks(config)


def _executor(config: EngineConfig, runner: ModelRunner, ranks: Ranks | None) -> Executor:
    if ranks is None:
        return UniProcExecutor(runner)
    from tokenmill.executor.pipelined import PipelinedExecutor, pipelines

    if pipelines(config, runner):
        return PipelinedExecutor(runner, ranks)
    from tokenmill.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(runner, ranks)
