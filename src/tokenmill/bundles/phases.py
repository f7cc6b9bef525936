"""Where a load's time goes: named phases timed and logged once at INFO.

``engine/loading.py`` (cold) and ``store.read_bundle`` (warm) time the same phases so the
two logs compare line for line: resolve (checkpoint, config, options; the bundle's key and
checksums), tokenizer, kernels (``select_ops``: the native library loaded or compiled),
weights (read, convert and pack; or map and assign). The builder adds the engine's own:
kv cache (sizing and allocation) and runner (on CUDA the decode-graph capture), then logs the
whole start once more; ``/metrics`` exposes the seconds (``metrics.startup``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("tokenmill.startup")


class Phases:
    """Seconds per phase name, in first-use order."""

    def __init__(self, seconds: dict[str, float] | None = None) -> None:
        self.seconds: dict[str, float] = dict(seconds or {})  # a copy: the caller's stays

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def log(self, what: str) -> None:
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in self.seconds.items())
        logger.info("%s: %s (total %.2f s)", what, parts, sum(self.seconds.values()))
