"""Loader fuzz: a few hundred mutations of a small GGUF and of a safetensors folder
(truncation, byte flips in the header, huge counts and lengths, nested arrays, zero
alignment, offsets past the end, lying safetensors headers). Each either loads or fails
with one of tokenmill's own errors (a clear message, no traceback from inside the
reader), quickly, and the whole run stays within a memory bound."""

from __future__ import annotations

import json
import random
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_synth import synthetic_tensors, write_gguf

from tokenmill.errors import TokenmillError
from tokenmill.loader import load_checkpoint
from tokenmill.structured_output.compile_cache import resident_bytes

PER_CASE_S = 10.0  # generous: each case takes milliseconds here
MEMORY_BOUND = 400 * 2**20


def _load_all(path: Path) -> str:
    """'ok', or the tokenmill error's message; any other exception fails the test."""
    try:
        checkpoint = load_checkpoint(str(path))
        for _ in checkpoint.weights(torch.float32):
            pass
        for _ in checkpoint.weights(torch.float32, keep_quantized=True):
            pass
    except TokenmillError as e:
        return str(e)
    return "ok"


class PeakRSS:
    """The highest resident size seen while the block runs (sampled every 2 ms), as growth
    over the resident size at its start. (``ru_maxrss`` is the whole process's peak so
    far, which earlier tests of a full run may have set far higher.)"""

    def __enter__(self) -> PeakRSS:
        self.before = self.peak = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.before


def _run(cases: list[tuple[str, bytes]], target: Path) -> dict[str, str]:
    with PeakRSS() as rss:
        results = _run_cases(cases, target)
    assert rss.growth < MEMORY_BOUND, f"peak RSS grew by {rss.growth >> 20} MiB"
    return results


def _run_cases(cases: list[tuple[str, bytes]], target: Path) -> dict[str, str]:
    results = {}
    for name, data in cases:
        target.write_bytes(data)
        t0 = time.monotonic()
        try:
            results[name] = _load_all(target)
        except Exception as e:  # noqa: BLE001 - reported with the mutation that caused it
            pytest.fail(f"mutation {name}: {type(e).__name__}: {e}")
        assert time.monotonic() - t0 < PER_CASE_S, name
    return results


# -- GGUF ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "small.gguf"
    write_gguf(path, synthetic_tensors([Q.Q4_0, Q.Q8_0, Q.F16], layers=1))
    return path.read_bytes()


def _header_end(data: bytes) -> int:
    """Roughly where the tensor data starts (the header is what the fuzzing targets)."""
    return min(len(data), 4096)


def _patch_u64(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + struct.pack("<Q", value) + data[offset + 8 :]


def _kv_value_offset(data: bytes, key: str) -> int:
    """Byte offset of the value of metadata ``key`` (after its type id)."""
    i = data.index(key.encode())
    return i + len(key) + 4


def _gguf_cases(data: bytes) -> list[tuple[str, bytes]]:
    rng = random.Random(1234)
    end = _header_end(data)
    cases = [
        (f"truncate@{n}", data[:n])
        for n in sorted({0, 3, 4, 8, 16, 23, 24, 25, *rng.sample(range(26, len(data)), 60)})
    ]
    for k in range(200):
        pos = rng.randrange(4, end)
        cases.append(
            (f"flip@{pos}#{k}", data[:pos] + bytes([rng.randrange(256)]) + data[pos + 1 :])
        )
    cases += [
        ("n_tensors=2^62", _patch_u64(data, 8, 2**62)),
        ("n_kv=2^63", _patch_u64(data, 16, 2**63)),
        ("n_kv=0", _patch_u64(data, 16, 0)),
    ]
    arch = _kv_value_offset(data, "general.architecture")
    cases.append(("string_length=2^60", _patch_u64(data, arch, 2**60)))
    length_pos = data.index(b"blk.0.attn_q.weight") - 8
    cases.append(("tensor_name_length=2^40", _patch_u64(data, length_pos, 2**40)))
    name_end = length_pos + 8 + len(b"blk.0.attn_q.weight")
    cases.append(("n_dims=2^31", data[:name_end] + struct.pack("<I", 2**31) + data[name_end + 4 :]))
    cases.append(("dim=2^60", _patch_u64(data, name_end + 4, 2**60)))
    cases.append(("dim=3 (partial block)", _patch_u64(data, name_end + 4, 3)))
    offset_pos = name_end + 4 + 2 * 8 + 4
    cases.append(("offset past the end", _patch_u64(data, offset_pos, 2**50)))
    return cases


def test_gguf_mutations_fail_clearly(gguf_bytes, tmp_path):
    cases = _gguf_cases(gguf_bytes)
    assert len(cases) >= 250
    results = _run(cases, tmp_path / "m.gguf")
    assert results["truncate@0"] != "ok" and "n_kv=2^63" in results
    for name in (
        "n_tensors=2^62",
        "n_kv=2^63",
        "string_length=2^60",
        "tensor_name_length=2^40",
        "n_dims=2^31",
        "dim=2^60",
        "offset past the end",
    ):
        assert "corrupt" in results[name] or "truncated" in results[name], (name, results[name])


def _gguf_with_alignment(tmp_path: Path, alignment: int) -> bytes:
    """The small GGUF with its uint32 llama.context_length KV renamed general.alignment."""
    path = tmp_path / "aligned.gguf"
    write_gguf(path, synthetic_tensors([Q.Q8_0], layers=1))
    data = path.read_bytes()
    key, new_key = b"llama.context_length", b"general.alignment"
    i = data.index(key)
    renamed = data[: i - 8] + struct.pack("<Q", len(new_key)) + new_key + data[i + len(key) :]
    value = i + len(new_key) + 4  # after the key, its uint32 type id
    return renamed[:value] + struct.pack("<I", alignment) + renamed[value + 4 :]


@pytest.mark.parametrize("alignment", [0, 7])
def test_zero_or_odd_alignment_is_a_clear_error(tmp_path, alignment):
    path = tmp_path / "a.gguf"
    path.write_bytes(_gguf_with_alignment(tmp_path, alignment))
    message = _load_all(path)
    assert f"general.alignment = {alignment}" in message


def test_deeply_nested_metadata_arrays_are_a_clear_error(tmp_path):
    key = b"x.nested"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    kv += struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv
    path = tmp_path / "nested.gguf"
    path.write_bytes(data)
    t0 = time.monotonic()
    message = _load_all(path)
    assert "nested deeper" in message and time.monotonic() - t0 < PER_CASE_S


# -- safetensors -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("fuzz-hf")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": 32,
        "max_position_embeddings": 64,
    }
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(32, 8, generator=gen),
            "model.norm.weight": torch.ones(8),
            "lm_head.weight": torch.randn(32, 8, generator=gen).to(torch.bfloat16),
        },
        str(folder / "model.safetensors"),
    )
    return folder


def _lying_headers(data: bytes) -> list[tuple[str, bytes]]:
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    cases = []

    def with_header(name: str, h: dict) -> None:
        text = json.dumps(h).encode()
        cases.append((name, struct.pack("<Q", len(text)) + text + body))

    first = next(k for k in header if k != "__metadata__")
    for name, change in [
        ("offsets past the end", {"data_offsets": [0, len(body) * 100]}),
        ("reversed offsets", {"data_offsets": [64, 0]}),
        ("shape larger than its bytes", {"shape": [1 << 20, 1 << 20]}),
        ("negative shape", {"shape": [-1, 8]}),
        ("unknown dtype", {"dtype": "F128"}),
        ("dtype of other size", {"dtype": "F64"}),
    ]:
        h = json.loads(json.dumps(header))
        h[first].update(change)
        with_header(name, h)
    cases.append(("header length 2^62", struct.pack("<Q", 2**62) + data[8:]))
    cases.append(("header length past the end", struct.pack("<Q", len(data)) + data[8:]))
    cases.append(("header not JSON", struct.pack("<Q", n) + b"{" * n + body))
    return cases


def test_safetensors_mutations_fail_clearly(hf_folder, tmp_path):
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    data = (hf_folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    rng = random.Random(99)
    cases = [
        (f"truncate@{k}", data[:k])
        for k in sorted({0, 4, 8, 9, *rng.sample(range(10, len(data)), 40)})
    ]
    for k in range(120):
        pos = rng.randrange(0, 8 + n)
        cases.append(
            (f"flip@{pos}#{k}", data[:pos] + bytes([rng.randrange(256)]) + data[pos + 1 :])
        )
    lies = _lying_headers(data)
    results = {}
    with PeakRSS() as rss:
        for name, blob in cases + lies:
            (folder / "model.safetensors").write_bytes(blob)
            t0 = time.monotonic()
            try:
                results[name] = _load_all(folder)
            except Exception as e:  # noqa: BLE001 - reported with the mutation that caused it
                pytest.fail(f"mutation {name}: {type(e).__name__}: {e}")
            assert time.monotonic() - t0 < PER_CASE_S, name
    assert rss.growth < MEMORY_BOUND, f"peak RSS grew by {rss.growth >> 20} MiB"
    for name, _ in lies:
        assert results[name] != "ok", name
