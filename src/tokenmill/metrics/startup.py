"""``tokenmill:startup_phase_seconds{phase=...}``: where the engine's start went (resolve,
tokenizer, kernels, weights, bundle write, kv cache, runner), from ``LLMEngine.startup_phases``.
Read when scraped; nothing while the engine loads."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

NAME = "tokenmill:startup_phase_seconds"


class StartupCollector(Collector):
    def __init__(self, phases: Callable[[], dict[str, float]], model_name: str) -> None:
        self._phases = phases
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        phases = self._phases()
        if not phases:
            return
        g = GaugeMetricFamily(NAME, "Seconds of each start-up phase of the engine.",
                              labels=["model_name", "phase"])  # fmt: skip
        for phase, seconds in phases.items():
            g.add_metric([self._model, phase], seconds)
        yield g


def engine_startup_phases(llm: object) -> dict[str, float]:
    """The start-up phases of the engine behind a front end (none for engines without one:
    a data-parallel router, a speech engine)."""
    engine = getattr(llm, "engine", None)
    return dict(getattr(engine, "startup_phases", None) or {})
