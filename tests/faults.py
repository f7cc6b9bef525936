"""Injected failures for the tests of error handling."""

from __future__ import annotations


def fail_launch(monkeypatch, runner, call: int, message: str = "boom") -> None:
    """The runner's ``call``-th launch (1-based) raises RuntimeError(message); the others run."""
    real = runner.launch
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError(message)
        return real(sched)

    monkeypatch.setattr(runner, "launch", flaky)
