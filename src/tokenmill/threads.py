"""How many CPU threads the kernels use (PyTorch's intra-op pool; the native kernels share it).

Two threads per core fight over the same execution units and every OpenMP barrier then
waits for the slowest thread, so more threads than usable CPUs is always slower. PyTorch
sizes its pool from the machine's core count, which in a container with a CPU set can
exceed the CPUs the process may actually use: lower it to those.
"""

from __future__ import annotations

import logging
import os

import torch

from tokenmill.env import TOKENMILL_NUM_THREADS

logger = logging.getLogger(__name__)


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
