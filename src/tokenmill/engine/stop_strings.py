"""Stop-string detection over incrementally decoded text."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopStringMatcher:
    """Holds back the last ``max(len(stop)) - 1`` characters until they can not
    start a stop string, so streamed text never shows part of one."""

    stops: list[str]
    include_stop: bool = False
    pending: str = ""

    @property
    def hold(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add new text; return (text safe to emit now, the stop string hit or None)."""
        buf = self.pending + delta
        hit = self._earliest(buf)
        if hit is not None:
            idx, stop = hit
            self.pending = ""
            return buf[: idx + len(stop)] if self.include_stop else buf[:idx], stop
        cut = max(len(buf) - self.hold, 0)
        self.pending = buf[cut:]
        return buf[:cut], None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _earliest(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = buf.find(stop)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best
