"""``/metrics`` families of the multimodal counters (``tokenmill:mm_*``), read when scraped
from the engine's processor and the runner's encoder step; none for a text-only model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.multimodal.prompt import multimodal_metrics

_COUNTERS = {
    "mm_items_processed": "Media items processed at the boundary.",
    "mm_preprocess_seconds": "Seconds spent decoding and processing media.",
    "mm_encoder_runs": "Media items the encoder computed.",
    "mm_encoder_cache_hits": "Media items served from the encoder cache.",
    "mm_encoder_seconds": "Seconds spent in the media encoder.",
    "mm_encoder_cache_evictions": "Encoder cache entries evicted for its byte budget.",
}
_GAUGES = {
    "mm_encoder_cache_entries": "Media embeddings in the encoder cache.",
    "mm_encoder_cache_bytes": "Bytes held by the encoder cache.",
}


def engine_multimodal_metrics(engine: Any) -> dict[str, float | int]:
    """The counters of an engine ({} for a text-only model or none): its processor's, and
    its encoder's (an ``EngineView``'s come from the engine process's latest snapshot)."""
    if engine is None or getattr(engine, "mm_processor", None) is None:
        return {}
    return multimodal_metrics(engine.mm_processor, None) | engine.encoder_metrics()


class MultiModalCollector(Collector):
    def __init__(self, values: Callable[[], dict[str, float | int]], model_name: str) -> None:
        self._values = values
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        values = self._values()
        for table, family in ((_COUNTERS, CounterMetricFamily), (_GAUGES, GaugeMetricFamily)):
            for name, doc in table.items():
                if name in values:
                    m = family("tokenmill:" + name, doc, labels=["model_name"])
                    m.add_metric([self._model], values[name])
                    yield m
