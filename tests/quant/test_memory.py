"""Loading the default GGUF quantized never holds much more than the quantized weights, and
a warm start from its prepared bundle holds almost none of them (mapped, not read)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Runs in a fresh process: resident memory high-water mark of load_model() only, after the
# imports and the tokenizer cache are warm; weights = every parameter and buffer of the
# model except the rotary tables.
SCRIPT = """
from pathlib import Path
def rss(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
from tokenmill.config import EngineConfig
from tokenmill.engine.loading import load_model
from tokenmill.loader import load_checkpoint
from tokenmill import native
from tokenmill.tokenizer import load_tokenizer
config = EngineConfig(prepare_bundle={prepare}, cache_dir={cache!r})
load_tokenizer(load_checkpoint(config.model), None)
native.available()
Path("/proc/self/clear_refs").write_text("5")
before = rss("VmRSS:")
loaded = load_model(config)
peak = rss("VmHWM:") - before
tensors = [*loaded.model.named_parameters(), *loaded.model.named_buffers()]
weights = sum(t.numel() * t.element_size() for n, t in tensors if "_cache" not in n)
print(loaded.quantization, weights, peak)
"""


def _load_peak(prepare: bool, cache) -> tuple[int, int]:
    script = SCRIPT.format(prepare=prepare, cache=str(cache))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    quantization, weights, peak = out.stdout.split()
    assert quantization == "gguf"
    print(f"weights {int(weights) / 1e6:.1f} MB, load peak {int(peak) / 1e6:.1f} MB")
    return int(weights), int(peak)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_load_peak_within_1_3x_of_the_quantized_weights(smollm2_gguf, tmp_path) -> None:
    weights, peak = _load_peak(False, tmp_path)  # cold: read, convert, pack
    assert peak <= 1.3 * weights, (weights, peak)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_warm_start_maps_the_weights(smollm2_gguf, tmp_path) -> None:
    _load_peak(True, tmp_path)  # the first start writes the bundle
    weights, peak = _load_peak(True, tmp_path)
    assert peak <= 0.5 * weights, (weights, peak)
