"""Data parallelism: N engine replicas on Ray behind one server, routed by cached prefix.

``DataParallelRouter`` is the server's ``AsyncLLM``: admission, draining and the request
streams are its own; each accepted request goes to one replica (``ReplicaClient``, an
engine in a Ray actor of one placement group) chosen by a routing policy
(``routing.py``) from the replicas' published prefix-cache blocks and their requests in
flight. A replica's outputs go straight to the request's stream.

A monitor thread pulls each replica's block events every ``EVENTS_INTERVAL_S`` and
restarts a replica that died. When one dies, its requests that had produced no output
yet are sent to another replica (``RouterStats.retried``); the others fail with a clean
error. Until the replacement is up the router serves with fewer replicas
(``health()``: degraded).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, cast

from tokenmill.config import EngineConfig
from tokenmill.distributed.block_events import block_events
from tokenmill.distributed.replica import ReplicaClient, actor_class
from tokenmill.distributed.routing import POLICIES, PrefixIndex, RouterStats, prompt_chain
from tokenmill.engine.async_llm import AsyncLLM, _Abort, _Add, _Call, _Stop
from tokenmill.engine.core_process import EngineView, _Forward
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.engine_core import SERVER_STATS, CoreOptions
from tokenmill.engine.request_stream import ACCEPTED
from tokenmill.errors import EngineDeadError
from tokenmill.metrics.stats import EngineStats
from tokenmill.outputs import RequestOutput
from tokenmill.structured_output.limits import GrammarLimits

logger = logging.getLogger(__name__)

EVENTS_INTERVAL_S = 0.05


@dataclass
class _Routed:
    """A request in flight on a replica."""

    replica: int
    cmd: _Add
    output: bool = False
    """It produced output (a retry would repeat it): a replica's death fails it."""
    accepted: bool = False
    """Its stream got ``ACCEPTED`` (a retry's second one is dropped)."""


class DataParallelRouter(AsyncLLM):
    def __init__(
        self,
        config: EngineConfig,
        max_queued_requests: int | None = None,
        queue_timeout: float | None = None,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        parallel = config.parallel
        self.size = parallel.data_parallel_size
        self.replica_config = _replica_config(config)
        self.options = CoreOptions(queue_timeout, grammar_limits, logging.WARNING)
        self.policy = POLICIES[parallel.data_parallel_routing]()
        self.router_stats = RouterStats()
        self._routed: dict[str, _Routed] = {}
        self._route_lock = threading.RLock()
        self._stop = threading.Event()
        self.indexes = [PrefixIndex() for _ in range(self.size)]
        self.block_size = config.block_size
        self.stats = EngineStats()
        """The replicas' counters summed (``_merge_stats``), the refusals the router's."""
        # One thread owns Ray for the router's life: a local cluster's processes die with
        # the thread that started them (the server loads the model in a passing thread).
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._owner = threading.Thread(
            target=self._own, args=(parallel, started), name="tokenmill-dp", daemon=True
        )
        self._owner.start()
        self.replicas: list[ReplicaClient | None]
        started.result()  # raises what stopped the replicas from starting
        view = RouterView(self, cast(ReplicaClient, self.replicas[0]).engine)
        super().__init__(cast(LLMEngine, view), max_queued_requests, queue_timeout)

    def _own(self, parallel: Any, started: concurrent.futures.Future) -> None:
        """The owner thread: start Ray and the replicas, then watch them until stopped."""
        try:
            ray = _import_ray()
            self._owns_ray = not ray.is_initialized()
            if self._owns_ray:  # and ends it: its processes would die with this thread
                ray.init(address=parallel.ray_address, include_dashboard=False,
                         num_cpus=None if parallel.ray_address else self.size,
                         log_to_driver=False)  # fmt: skip
            self.placement = ray.util.placement_group([{"CPU": 1}] * self.size, strategy="PACK")
            ray.get(self.placement.ready())
            actors = [self._new_actor(i) for i in range(self.size)]  # they load in parallel
            self.replicas = [self._connect(i, a) for i, a in enumerate(actors)]
            started.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - raised by __init__
            started.set_exception(exc)
            return
        self._monitor()

    # -- replicas -------------------------------------------------------------------------
    def _new_actor(self, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.placement, index)
        cls = actor_class(1)
        return cls.options(scheduling_strategy=strategy, name=None).remote(
            self.replica_config, self.options
        )

    def _connect(self, index: int, actor: Any) -> ReplicaClient:
        return ReplicaClient(index, actor, self.replica_config, self.options, self._on_item)

    def _up(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r is not None and r.is_ready]

    def health(self) -> dict[str, Any]:
        live = len(self._up())
        status = "ok" if live == self.size else "degraded" if live else "down"
        return {"status": status, "replicas": self.size, "replicas_up": live}

    @property
    def is_ready(self) -> bool:
        return self._accepting and bool(self._up()) and not self._stop.is_set()

    # -- routing (AsyncLLM's commands) ------------------------------------------------------
    def _start(self) -> threading.Thread:
        self._commands = _Forward(self._dispatch)  # type: ignore[assignment]  # routes at once
        return self._owner  # already watching the replicas

    def _dispatch(self, cmd: object) -> None:
        if isinstance(cmd, _Add):
            self._place(cmd)
        elif isinstance(cmd, _Abort):
            with self._route_lock:
                routed = self._routed.get(cmd.request_id)
            replica = None if routed is None else self.replicas[routed.replica]
            if replica is not None:
                replica._forward(cmd)
        elif isinstance(cmd, _Call):
            replica = self.replicas[self._up()[0]] if self._up() else None
            if replica is None:
                cmd.future.set_exception(EngineDeadError("no data-parallel replica is up"))
            else:
                replica._forward(cmd)
        elif isinstance(cmd, _Stop):
            self._stop.set()

    def _place(self, cmd: _Add, accepted: bool = False) -> None:
        live = self._up()
        if not live:
            self._done(started=False)
            cmd.stream.put(EngineDeadError("no data-parallel replica is up"))
            return
        key = cmd.options.block_key() if cmd.options else b""
        chain = prompt_chain(cmd.prompt_token_ids, self.block_size, key)
        with self._route_lock:
            loads = Counter(r.replica for r in self._routed.values())
            choice = self.policy.choose(chain, self.block_size, live, self.indexes,
                                        [loads[i] for i in range(self.size)])  # fmt: skip
            self._routed[cmd.stream.request_id] = _Routed(choice.replica, cmd, accepted=accepted)
            stats = self.router_stats
            stats.routed[choice.replica] += 1
            stats.prompt_tokens += len(cmd.prompt_token_ids)
            stats.matched_tokens += choice.matched_tokens
        replica = self.replicas[choice.replica]
        assert replica is not None
        replica._forward_add(cmd)

    def _on_item(self, stream, item: object) -> bool:
        """A replica's item for ``stream``: count it; True delivers it."""
        rid = stream.request_id
        with self._route_lock:
            routed = self._routed.get(rid)
            if routed is None:
                return True
            if item is ACCEPTED:
                if routed.accepted:
                    return False
                routed.accepted = True
            if isinstance(item, EngineDeadError) and not routed.output and not self._stop.is_set():
                self.router_stats.retried += 1
                self._routed.pop(rid)
                retry = routed.cmd
            else:
                retry = None
                if isinstance(item, RequestOutput) and not routed.output:
                    routed.output = True
                    with self._lock:
                        self._num_queued -= 1
                if _is_last(item):
                    self._routed.pop(rid)
                    self._done(started=routed.output)
        if retry is not None:  # on another replica (this one is gone)
            threading.Thread(target=self._place, args=(retry, routed.accepted), daemon=True).start()
            return False
        return True

    # -- the monitor thread -----------------------------------------------------------------
    def _monitor(self) -> None:
        while not self._stop.wait(EVENTS_INTERVAL_S):
            for i, replica in enumerate(self.replicas):
                if replica is None:
                    continue
                if not replica.is_ready and not self._stop.is_set():
                    self._restart(i)
                    continue
                events = _call(replica, block_events)
                if events is not None:
                    self.indexes[i].apply(events)
            self._merge_stats()
        self._shutdown_replicas()

    def _restart(self, index: int) -> None:
        logger.warning("data-parallel replica %d is down: restarting it", index)
        dead, self.replicas[index] = self.replicas[index], None
        self.indexes[index] = PrefixIndex()  # its cache went with it
        if dead is not None:
            dead._cmd_send.close()
        self.router_stats.restarts += 1
        threading.Thread(target=self._replace, args=(index,), daemon=True).start()

    def _replace(self, index: int) -> None:
        try:
            client = self._connect(index, self._new_actor(index))
        except Exception:  # noqa: BLE001 - logged; the slot stays down
            logger.exception("restarting data-parallel replica %d failed", index)
            return
        if self._stop.is_set():
            client.shutdown()
            return
        self.replicas[index] = client
        logger.warning("data-parallel replica %d is back", index)

    # -- reading all replicas -----------------------------------------------------------------
    def _merge_stats(self) -> None:
        """Sum the replicas' counters into ``stats`` (histograms: the first replica's);
        the refusals (``SERVER_STATS``) are the router's own."""
        views = [r.engine.stats for r in self.replicas if r is not None]
        if not views:
            return
        for f in fields(EngineStats):
            if f.name in SERVER_STATS:
                continue
            values = [getattr(v, f.name) for v in views]
            if isinstance(values[0], (int, Counter)) and not isinstance(values[0], bool):
                total = values[0]
                for v in values[1:]:
                    total = total + v
                setattr(self.stats, f.name, total)
            else:
                setattr(self.stats, f.name, values[0])

    def replica_report(self) -> list[dict[str, float]]:
        """Per replica slot (``router_metrics.py``): routed, up, its engine's counters."""
        report = []
        for i, r in enumerate(self.replicas):
            row: dict[str, float] = {"router_requests": self.router_stats.routed[i],
                                     "replica_up": float(r is not None and r.is_ready)}  # fmt: skip
            if r is not None:
                s = r.engine.stats
                row |= {"replica_num_requests_running": s.num_running,
                        "replica_prompt_tokens": s.prompt_tokens,
                        "replica_generation_tokens": s.generation_tokens,
                        "replica_prefix_cache_reused_tokens":
                            r.engine.prefix_cache_metrics().get("prefix_cache_reused_tokens", 0)}  # fmt: skip
            report.append(row)
        return report

    async def reset_prefix_cache(self) -> int:
        total = 0
        for r in list(self.replicas):
            if r is not None:
                total += await r.reset_prefix_cache()
        return total

    # -- lifecycle ------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        self.stop_accepting()
        self._stop.set()
        self._thread.join(timeout)

    def _shutdown_replicas(self) -> None:
        import ray

        for r in self.replicas:
            if r is not None:
                r.shutdown(5.0)
        ray.util.remove_placement_group(self.placement)
        if self._owns_ray:
            ray.shutdown()


def _import_ray() -> Any:
    """Ray, told not to install its failure-signal handler: on the SIGTERM with which the
    server starts draining, that handler lets the process abort at its next shutdown step
    (exit code 134 instead of 0 after a clean drain)."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")  # read at import
    import ray

    return ray


def _is_last(item: object) -> bool:
    return isinstance(item, BaseException) or bool(getattr(item, "finished", False))


def _call(replica: ReplicaClient, fn) -> Any:
    """``fn(engine)`` on a replica's engine thread, from a plain thread; None if it fails."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    replica._forward(_Call(fn, future))
    try:
        return future.result(timeout=5.0)
    except Exception:  # noqa: BLE001 - a replica going down; the monitor sees it next
        return None


def _replica_config(config: EngineConfig) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, data_parallel_size=1, ray_address=None)


class RouterView:
    """What the server reads of "the engine": replica 0's fixed facts (tokenizer, limits,
    grammar compiler), the KV usage and prefix-cache counters of all replicas."""

    def __init__(self, router: DataParallelRouter, first: Any) -> None:
        self._router, self._first = router, first
        self.config, self.tokenizer = first.config, first.tokenizer
        self.max_model_len, self.vocab_size = first.max_model_len, first.vocab_size
        self.structured, self.loaded = first.structured, first.loaded
        if hasattr(first, "mm_processor"):  # replica 0's, as every replica's is the same
            self.mm_processor = first.mm_processor
            """Media become tensors in the server process; the chosen replica encodes them."""

    @property
    def stats(self) -> EngineStats:
        return self._router.stats

    @property
    def kv(self) -> Any:
        """Mean usage over the replicas that are up."""
        views = [r.engine.kv for r in self._router.replicas if r is not None]
        usage = sum(v.usage for v in views) / len(views) if views else 0.0
        return _KVUsage(usage, sum(v.num_blocks for v in views),
                        sum(v.num_free_blocks for v in views))  # fmt: skip

    def encoder_metrics(self) -> dict[str, float | int]:
        """The replicas' encoder counters, summed (``multimodal_metrics`` names)."""
        total: Counter[str] = Counter()
        for r in self._router.replicas:
            if r is not None:
                total.update(cast(EngineView, r.engine).encoder_metrics())
        return dict(total)

    def prefix_cache_metrics(self) -> dict[str, int | float]:
        """Summed over the replicas (``LLMEngine.prefix_cache_metrics`` names)."""
        total: Counter[str] = Counter()
        for r in self._router.replicas:
            if r is not None:
                total.update(r.engine.prefix_cache_metrics())
        return dict(total)


@dataclass(frozen=True)
class _KVUsage:
    usage: float
    num_blocks: int
    num_free_blocks: int
