"""speech.workers.TaskPool (order, errors, threads) and the vocoder's piece plan."""

from __future__ import annotations

import threading

import pytest
import torch

from tokenmill.speech.vits import CONTEXT, SHAPE_BUCKET, pieces
from tokenmill.speech.workers import TaskPool


def test_lowest_key_first_and_errors():
    pool = TaskPool(1)
    gate, ran = threading.Event(), []
    busy = pool.submit((0,), gate.wait)
    futures = [pool.submit(key, lambda k=key: ran.append(k)) for key in [(3,), (1, 2), (1, 1)]]
    tie = [pool.submit((5,), lambda i=i: ran.append(("tie", i))) for i in range(3)]
    bad = pool.submit((4,), lambda: 1 / 0)
    gate.set()
    for f in [busy, *futures, *tie]:
        f.result(10)
    assert ran == [(1, 1), (1, 2), (3,), ("tie", 0), ("tie", 1), ("tie", 2)]
    with pytest.raises(ZeroDivisionError):
        bad.result(10)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit((0,), lambda: None)


def test_close_cancels_the_waiting_tasks_and_waits_for_the_running_one():
    pool = TaskPool(2)
    gate, started, second = threading.Event(), threading.Event(), threading.Event()
    running = pool.submit((0,), lambda: started.set() or gate.wait())
    blocker = pool.submit((0,), lambda: second.set() or gate.wait())  # both workers busy
    assert started.wait(10) and second.wait(10)
    waiting = pool.submit((1,), lambda: "ran")
    threading.Timer(0.2, gate.set).start()
    pool.close()  # returns once the running tasks are done and the workers have ended
    assert running.done() and running.result() is True and blocker.result() is True
    assert waiting.cancelled()
    assert not any(t.is_alive() for t in pool._threads)


def test_close_from_a_worker_does_not_wait_for_itself():
    pool = TaskPool(2)
    assert pool.submit((0,), lambda: pool.close() or "closed").result(10) == "closed"
    for t in pool._threads:
        t.join(10)
        assert not t.is_alive()


def test_workers_run_one_thread_and_leave_the_default():
    before = torch.get_num_threads()
    pool = TaskPool(2)
    assert torch.get_num_threads() == before
    assert pool.submit((0,), torch.get_num_threads).result(10) == 1
    fresh: list[int] = []  # a thread starting torch later gets the default again
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [before]
    pool.close()


def test_piece_plan():
    def spans(plan):
        return [(p.start, p.end) for p in plan]

    assert spans(pieces(700, 24, 512)) == [(0, 24), (24, 362), (362, 700)]
    assert spans(pieces(300, 0, 512)) == [(0, 300)]
    assert spans(pieces(300, 24, 512, parts=2)) == [(0, 24), (24, 162), (162, 300)]
    assert spans(pieces(100, 0, 512, parts=2)) == [(0, 100)]  # under 2 x 64 frames: one
    assert spans(pieces(10, 24, 512)) == [(0, 10)]
    plan = pieces(700, 24, 512)
    # each window: CONTEXT frames either side, grown to a multiple of SHAPE_BUCKET (16)
    # frames, to the right while there are frames, else to the left
    assert [(p.lo, p.hi) for p in plan] == [(0, 48), (12, 380), (348, 700)]
    for total in (10, 37, 300, 700, 1500):
        for p in pieces(total, 24, 512, parts=2):
            assert p.lo <= max(0, p.start - CONTEXT) and p.hi >= min(total, p.end + CONTEXT)
            assert (p.hi - p.lo) % SHAPE_BUCKET == 0 or (p.lo, p.hi) == (0, total)


def test_stream_bytes_do_not_depend_on_the_workers(tts, piper_voice):
    from tokenmill.speech.tts import TTS

    text = "One short sentence. Then a second, somewhat longer one, to finish."
    one = TTS(piper_voice, warmup=False, workers=1)
    try:
        assert b"".join(one.generate_speech_stream(text)) == b"".join(
            tts.generate_speech_stream(text)
        )
    finally:
        one.close()
