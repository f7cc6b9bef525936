from __future__ import annotations

import pytest
import torch

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
