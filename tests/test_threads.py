from __future__ import annotations

import threading

import pytest
import torch
from openmp_probe import on_linux, run_probe

from tokenmill import threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_automatic_count_never_exceeds_the_usable_cpus(monkeypatch):
    monkeypatch.delenv("TOKENMILL_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 1)  # e.g. a container's CPU set
    assert threads.configure_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(threads, "usable_cpus", lambda: 64)  # never raised above PyTorch's
    assert threads.configure_threads() == 1


def test_explicit_count(monkeypatch):
    monkeypatch.setenv("TOKENMILL_NUM_THREADS", "1")
    assert threads.configure_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv("TOKENMILL_NUM_THREADS", "-2")
    with pytest.raises(ValueError, match="TOKENMILL_NUM_THREADS"):
        threads.configure_threads()
    monkeypatch.setenv("TOKENMILL_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="TOKENMILL_NUM_THREADS"):
        threads.configure_threads()


# -- OpenMP workers: a thread that hands its computing to another lets go of them -------------
@on_linux
def test_release_frees_the_calling_threads_openmp_workers():
    out = run_probe("""
x @ x  # this thread's first parallel op starts its OpenMP worker
with_pool = tasks()
release_openmp_threads()
released = settle(with_pool - 1)
x @ x  # the next one starts a new worker
print(with_pool, released, settle(with_pool))
""")
    with_pool, released, again = map(int, out.split())
    assert released == with_pool - 1
    assert again == with_pool


@on_linux
def test_an_llm_can_generate_from_another_thread_at_full_speed(tiny_llama_dir):
    """LLM() leaves its building thread without OpenMP workers (its next parallel op starts
    one), so a thread that generates later keeps spin-waiting at its ops' barriers."""
    out = run_probe(f"""
import threading
from tokenmill import LLM, SamplingParams

llm = LLM({str(tiny_llama_dir)!r}, dtype="float32", max_model_len=256, num_kv_blocks=64,
          block_size=4)
before = settle(tasks())
x @ x
started = settle(before + 1) - before
release_openmp_threads()
settle(before)
box = []

def other():
    llm.generate(["x"], SamplingParams(max_tokens=4), use_tqdm=False)
    box.append(sleeps_per_op())

t = threading.Thread(target=other)
t.start()
t.join()
print(started, box[0])
""")
    started, sleeps = out.split()
    assert started == "1"
    assert float(sleeps) < 0.5  # throttled: ~1 or more per op


def test_async_llm_releases_the_thread_that_built_the_engine(tiny_llm, monkeypatch):
    from tokenmill.engine import async_llm

    calls: list[threading.Thread] = []
    monkeypatch.setattr(
        async_llm, "release_openmp_threads", lambda: calls.append(threading.current_thread())
    )
    front = async_llm.AsyncLLM(tiny_llm.engine)
    try:
        assert calls == [threading.current_thread()]
    finally:
        front.shutdown()


def test_then_release_returns_and_raises_like_the_call(monkeypatch):
    released: list[bool] = []
    monkeypatch.setattr(threads, "release_openmp_threads", lambda: released.append(True))
    assert threads.then_release(lambda a, b=0: a + b, 2, b=3) == 5

    def fail() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        threads.then_release(fail)
    assert released == [True, True]
