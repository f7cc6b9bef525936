"""How many CPU threads the kernels use (PyTorch's intra-op pool; the native kernels share it).

Two threads per core fight over the same execution units and every OpenMP barrier then
waits for the slowest thread, so more threads than usable CPUs is always slower. PyTorch
sizes its pool from the machine's core count, which in a container with a CPU set can
exceed the CPUs the process may actually use: lower it to those.

One thread computes, the others hand it their work. libgomp (PyTorch's OpenMP runtime on
Linux, which the native kernels share) keeps a pool of worker threads for every thread
that ever ran a parallel op, for as long as that thread lives, and once the process holds
more such workers than CPUs it stops spin-waiting at barriers in *every* pool: each op then
ends in a futex sleep and wake-up. A server loads its model on the main thread (one pool)
and steps it on an engine thread (a second): on 2 cores that halved single-stream decode
(SmolLM2 Q4_1: 104 vs 251 tok/s) and slowed a Whisper decoder step from 6 to 9.5 ms. So a
thread that ran parallel ops and now hands the computing to another calls
``release_openmp_threads`` (after loading, before an engine thread starts; after request
preprocessing on a helper thread).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from tokenmill.env import TOKENMILL_NUM_THREADS

logger = logging.getLogger(__name__)

T = TypeVar("T")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure_threads() -> int:
    """Set PyTorch's thread count from TOKENMILL_NUM_THREADS (0: PyTorch's, capped at the
    usable CPUs); returns the count in use."""
    wanted = TOKENMILL_NUM_THREADS.get()
    if wanted < 0:
        raise ValueError(f"TOKENMILL_NUM_THREADS={wanted} must be 0 (automatic) or positive")
    current = torch.get_num_threads()
    target = wanted or min(current, usable_cpus())
    if target != current:
        torch.set_num_threads(target)
        logger.info("CPU threads: %d (was %d)", target, current)
    return target


OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` (OpenMP 5.0): free the calling thread's workers, keep the runtime."""


@functools.cache
def _openmp_runtime() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of PyTorch's OpenMP runtime: the copy under its package
    (other wheels, sentencepiece's for one, map their own), else an already loaded system
    ``libgomp.so.1`` (a distribution's torch links that); None when neither offers it."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to release here
        return None
    root = Path(torch.__file__).parent
    homes = (str(root) + os.sep, str(root.parent / "torch.libs") + os.sep)
    paths = [line.rsplit(" ", 1)[-1] for line in maps.splitlines()]
    ours = [p for p in paths if p.startswith(homes) and _is_openmp(os.path.basename(p))]
    try:
        lib = ctypes.CDLL(ours[0]) if ours else ctypes.CDLL("libgomp.so.1", os.RTLD_NOLOAD)
    except OSError:  # no OpenMP runtime loaded
        return None
    pause = getattr(lib, "omp_pause_resource_all", None)
    if pause is not None:
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def _is_openmp(name: str) -> bool:
    return name.startswith(("libgomp", "libiomp", "libomp"))


def release_openmp_threads() -> None:
    """Free the OpenMP worker threads of the calling thread (see the module's docstring).
    Its next parallel op starts new ones (tens of microseconds). A no-op where the runtime
    is not found or can not pause."""
    pause = _openmp_runtime()
    if pause is not None:
        pause(OMP_PAUSE_SOFT)


def then_release(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, then ``release_openmp_threads()``: for work a helper thread
    does for a request (preprocessing, decoding audio) beside an engine thread."""
    try:
        return fn(*args, **kwargs)
    finally:
        release_openmp_threads()
