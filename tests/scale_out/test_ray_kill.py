"""Killing a rank actor on the driver's node ends its process at once (``RayProc.kill``
sends SIGKILL besides ``ray.kill``), and only a process Ray titled as a rank actor: a pid
that another process has taken since is left alone."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tokenmill.distributed.ray_ranks import _kill_rank_process


def _start(title: str) -> subprocess.Popen:
    # exec -a: the process's argv[0] (its /proc cmdline), as Ray's setproctitle makes it
    return subprocess.Popen(["bash", "-c", f"exec -a '{title}' sleep 60"])


def _ended(proc: subprocess.Popen, within: float = 10.0) -> bool:
    try:
        proc.wait(within)
    except subprocess.TimeoutExpired:
        return False
    return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc here")
def test_a_rank_actors_process_is_killed_and_another_left_alone():
    rank, other = _start("ray::RankActor.run"), _start("sleep")
    try:
        time.sleep(0.3)  # exec has replaced bash
        _kill_rank_process(rank.pid)
        _kill_rank_process(other.pid)
        assert _ended(rank) and rank.returncode == -9
        assert not _ended(other, within=0.5)
        _kill_rank_process(rank.pid)  # gone (reaped): nothing to do, no error
    finally:
        for p in (rank, other):
            p.kill()
            p.wait()
