"""Engine statistics (``stats.py``) and their Prometheus export (``prometheus.py``)."""

from tokenmill.metrics.stats import EngineStats, Histogram

__all__ = ["EngineStats", "Histogram"]
