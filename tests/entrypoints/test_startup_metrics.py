"""/metrics says where the engine's start went: one gauge per start-up phase, the same
seconds the start-up log printed."""

from __future__ import annotations

from _serving_helpers import MODEL
from prometheus_client.parser import text_string_to_metric_families

PHASES = {"resolve", "tokenizer", "kernels", "weights", "kv cache", "runner"}


def test_startup_phases_are_exposed(http):
    phases = {
        s.labels["phase"]: s.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
        if s.name == "tokenmill:startup_phase_seconds" and s.labels["model_name"] == MODEL
    }
    assert PHASES <= set(phases)
    assert all(v >= 0 for v in phases.values())
    assert phases["weights"] > 0  # the load itself is never free
