"""Tensor- and pipeline-parallel ranks 1.. as Ray actors (``distributed_executor_backend="ray"``).

Each rank runs the mp backend's worker (``worker.worker_main``) inside an actor's method
call, so loading, the step loop and the collectives are the same code; only starting and
watching differ. The driver sees an actor as ``multiprocessing`` shows a process
(``RayProc``: alive while its ``run`` call is unfinished, killed with ``ray.kill``) and its
startup reports as a pipe (``RayPipe`` over a ``ray.util.queue.Queue``), so
``launch.Workers`` watches both backends alike. The process group meets at the driver's
node address (the loopback on a one-node cluster), so ranks may sit on other machines of
the cluster (``ray_address``).

Ray is started here when it is not running yet (a local cluster, or ``ray_address``), by a
thread that lives until the ranks stop: Ray ties its local processes to the thread that
started them (they die with it), and the server loads its engine on a short-lived thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.distributed.worker import WorkerArgs, worker_main

logger = logging.getLogger(__name__)


class RankActor:
    """The actor's class (``ray.remote`` is applied in ``start_actors``)."""

    def run(self, args: WorkerArgs, reports: Any) -> None:
        if args.config.torch_device().type == "cuda":  # Ray shows each actor its one GPU
            args = dataclasses.replace(args, device_index=0)
        worker_main(args, _Reports(reports))

    def place(self) -> tuple[int, str]:
        """(its process id, its Ray node's id)."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()


@dataclasses.dataclass(frozen=True)
class _Reports:
    """The worker's end of its report channel: what ``worker_main`` calls on a pipe."""

    queue: Any

    def send(self, report: object) -> None:
        self.queue.put(report)


class RayPipe:
    """The driver's end of a rank's reports, with a ``Connection``'s ``poll`` / ``recv``."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self._got: list[object] = []

    def poll(self, timeout: float | None = 0.0) -> bool:
        if not self._got:
            from ray.util.queue import Empty

            try:
                self._got.append(self.queue.get(timeout=timeout))
            except Empty:
                return False
        return True

    def recv(self) -> Any:
        self.poll(None)
        return self._got.pop(0)


class RayProc:
    """A rank's actor as ``launch.Workers`` watches a process. ``local``: its process runs
    on the driver's Ray node (``pid`` is one of this machine's)."""

    def __init__(self, actor: Any, call: Any, pid: int, local: bool = False) -> None:
        self.actor, self.call, self.pid, self.local = actor, call, pid, local

    def is_alive(self) -> bool:
        import ray

        done, _ = ray.wait([self.call], timeout=0)
        return not done

    @property
    def exitcode(self) -> int | None:
        """None while running; 0 after a clean stop, 1 after a failure or a kill."""
        import ray

        if self.is_alive():
            return None
        try:
            ray.get(self.call)
        except Exception:  # noqa: BLE001 - Ray's errors for a failed or killed actor
            return 1
        return 0

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.call], timeout=timeout)

    def kill(self) -> None:
        """``ray.kill`` marks the actor dead at once but may end its process later, and a
        live process keeps its sockets open (a full CI run saw the driver's next step reach
        a killed rank and then wait out the 120 s collective timeout): on this node the
        process is sent SIGKILL too, so its sockets close now and every peer's collective
        fails at once."""
        import ray

        if self.local:
            _kill_rank_process(self.pid)
        ray.kill(self.actor, no_restart=True)


def _kill_rank_process(pid: int) -> None:
    """SIGKILL ``pid`` if it is still a rank actor's process (Ray titles it
    ``ray::RankActor.<method>``; a pid reused by another process is left alone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().startswith(b"ray::RankActor"):
                return
        os.kill(pid, signal.SIGKILL)
    except OSError:  # gone already, or no /proc here
        pass


class RayOwner:
    """The thread that started Ray and shuts it down when told (None where Ray ran already)."""

    def __init__(self, address: str | None, num_cpus: int | None) -> None:
        self._stop = threading.Event()
        started = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._own, args=(address, num_cpus, started),
                                        name="tokenmill-ray", daemon=True)  # fmt: skip
        self._thread.start()
        started.wait()
        if self.error is not None:
            raise self.error

    def _own(self, address: str | None, num_cpus: int | None, started: threading.Event) -> None:
        import ray

        try:
            ray.init(address=address, num_cpus=num_cpus, include_dashboard=False,
                     log_to_driver=False)  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - raised by __init__
            self.error = e
            started.set()
            return
        started.set()
        self._stop.wait()
        ray.shutdown()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30.0)


def start_actors(
    config: EngineConfig, world: int, threads: int, port: int
) -> tuple[list[RayProc], list[RayPipe], str, RayOwner | None]:
    """Ranks 1..world-1 as actors (loading at once): their processes, their report pipes,
    the process group's address, and the owner of the Ray this started (None: Ray ran)."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")  # as the router
    import ray
    from ray.util.queue import Queue

    owner = None
    if not ray.is_initialized():
        address = config.parallel.ray_address
        cpus = None if address else max(os.cpu_count() or 1, (world - 1) * threads)
        owner = RayOwner(address, cpus)
    cuda = config.torch_device().type == "cuda"
    cls: Any = ray.remote(num_cpus=threads, num_gpus=1 if cuda else 0, max_restarts=0)(RankActor)
    # one node: the loopback (a sandbox may not route to its own address); else this node's
    host = "127.0.0.1" if len(ray.nodes()) == 1 else ray.util.get_node_ip_address()
    group_address = f"tcp://{host}:{port}"
    actors = [cls.options(name=None).remote() for _ in range(1, world)]
    places = ray.get([a.place.remote() for a in actors])  # before run: one call at a time
    here = ray.get_runtime_context().get_node_id()
    procs, pipes = [], []
    for rank, actor, (pid, node) in zip(range(1, world), actors, places):
        queue = Queue()
        call = actor.run.remote(WorkerArgs(config, rank, world, group_address, threads), queue)
        procs.append(RayProc(actor, call, pid, local=node == here))
        pipes.append(RayPipe(queue))
    logger.info("%d ranks started as Ray actors (process group at %s)", world - 1, group_address)
    return procs, pipes, group_address, owner
