from __future__ import annotations

import sys

import pytest
import torch

from tokenmill import host_memory


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(host_memory, "_done", False)


def test_off_leaves_malloc_alone(fresh, monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOST_MALLOC", "0")
    assert not host_memory.keep_freed_memory()


def test_a_bad_value_names_the_variable(fresh, monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOST_MALLOC", "yes")
    with pytest.raises(ValueError, match="TOKENMILL_HOST_MALLOC"):
        host_memory.keep_freed_memory()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_on_linux_the_thresholds_are_set_once_and_memory_still_works(fresh, monkeypatch):
    monkeypatch.delenv("TOKENMILL_HOST_MALLOC", raising=False)
    assert host_memory.keep_freed_memory()
    assert host_memory.keep_freed_memory()  # idempotent
    for _ in range(3):  # blocks around both thresholds come and go as before
        for mb in (1, 20, 40):
            t = torch.ones(mb << 18)
            assert t.sum().item() == mb << 18
            del t
