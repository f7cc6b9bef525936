"""Which ISA level the native library is built for: the levels a CPU runs (from its
``/proc/cpuinfo`` flags, faked here), ``TOKENMILL_NATIVE_ISA``, a level the CPU lacks (a
ValueError, never an illegal instruction), one cached library per level, the load log,
and ``native.use``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill import native

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}


@pytest.fixture
def fake_cpu(monkeypatch):
    """Sets the CPU's flags (x86-64) for ``isas_available`` and ``default_isa``; nothing is
    built or loaded."""

    def set_flags(flags: set[str], machine: str = "x86_64") -> None:
        monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(native.platform, "machine", lambda: machine)
        native.default_isa.cache_clear()

    monkeypatch.delenv("TOKENMILL_NATIVE_ISA", raising=False)
    yield set_flags
    native.default_isa.cache_clear()  # re-read on the real CPU by the next caller


@pytest.mark.parametrize(
    ("flags", "machine", "levels"),
    [
        (AVX512, "x86_64", ("avx512", "avx2")),
        (AVX2, "x86_64", ("avx2",)),
        (AVX2 - {"f16c"}, "x86_64", ()),  # Sandy Bridge .. Ivy Bridge lack FMA/F16C: below
        (AVX2 | {"avx512f"}, "x86_64", ("avx2",)),  # AVX-512F without VNNI: the AVX2 code
        (AVX512, "aarch64", ()),
    ],
)
def test_levels_follow_the_cpu_flags(fake_cpu, flags, machine, levels) -> None:
    fake_cpu(flags, machine)
    assert native.isas_available() == levels
    assert native.default_isa() == (levels[0] if levels else None)


def test_the_variable_picks_a_lower_level(fake_cpu, monkeypatch) -> None:
    fake_cpu(AVX512)
    monkeypatch.setenv("TOKENMILL_NATIVE_ISA", " AVX2 ")
    native.default_isa.cache_clear()
    assert native.default_isa() == "avx2"


@pytest.mark.parametrize("value", ["sse4", "avx-512", "native"])
def test_an_unknown_level_names_the_variable(fake_cpu, monkeypatch, value) -> None:
    fake_cpu(AVX512)
    monkeypatch.setenv("TOKENMILL_NATIVE_ISA", value)
    native.default_isa.cache_clear()
    with pytest.raises(ValueError, match=r"TOKENMILL_NATIVE_ISA=.* \(one of: avx512, avx2\)"):
        native.default_isa()


def test_a_level_the_cpu_lacks_is_a_value_error(fake_cpu, monkeypatch) -> None:
    fake_cpu(AVX2)
    monkeypatch.setenv("TOKENMILL_NATIVE_ISA", "avx512")
    native.default_isa.cache_clear()
    with pytest.raises(ValueError, match=r"TOKENMILL_NATIVE_ISA='avx512' needs .*avx512_vnni"):
        native.default_isa()
    with pytest.raises(
        ValueError, match=r"isa='avx512' needs CPU flags avx512_vnni, avx512bw, avx512f"
    ):
        native.library("avx512")  # refused before anything is built or loaded
    with pytest.raises(ValueError, match="no native ISA level"):
        native.library("avx3")


def test_each_level_has_its_own_cached_library(fake_cpu) -> None:
    fake_cpu(AVX512)
    paths = {isa: native.library_path(isa) for isa in ("avx512", "avx2")}
    assert paths["avx512"] != paths["avx2"]
    assert all(isa in p.name for isa, p in paths.items())
    fake_cpu(AVX512 - {"avx512_bf16"})  # -march=native follows the flags: another build
    assert native.library_path("avx512") != paths["avx512"]


@pytest.mark.skipif(not native.isas_available(), reason="no native ISA level on this CPU")
def test_the_load_log_names_the_level_once(tmp_path) -> None:
    """A fresh process loading the default library logs its level once, however often the
    wrappers ask for it."""
    code = (
        "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from tokenmill import native\n"
        "assert native.available() and native.available()\n"
        "print(native.active_isa())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    isa = done.stdout.strip()
    assert isa == native.default_isa()
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("native CPU kernels: ISA")]
    assert len(lines) == 1 and lines[0].startswith(f"native CPU kernels: ISA level {isa} ")


def test_use_none_forces_the_pytorch_path() -> None:
    before = native.available()
    with native.use(None):
        assert not native.available()
        assert native.active_isa() is None
        with pytest.raises(RuntimeError, match=r"native.use\(None\)"):
            native.add_rms_norm(None, native.torch.ones(1, 16), native.torch.ones(16), 1e-6)
    assert native.available() == before


@pytest.mark.skipif(not native.isas_available(), reason="no native ISA level on this CPU")
def test_use_nests_and_restores() -> None:
    lowest = native.isas_available()[-1]
    with native.use(lowest):
        assert native.active_isa() == lowest
        with native.use(None):
            assert native.active_isa() is None
        assert native.active_isa() == lowest and native.available()
    assert native.active_isa() == native.default_isa()


def test_use_refuses_a_level_the_cpu_lacks(fake_cpu) -> None:
    fake_cpu(AVX2)
    with pytest.raises(ValueError, match="avx512"):
        with native.use("avx512"):
            pass


def test_native_isa_fixture_sets_the_level(native_isa) -> None:
    if native_isa == "fallback":
        assert not native.available()
    else:
        assert native.active_isa() == native_isa


@pytest.mark.parametrize(
    ("isa", "vendor", "value", "native_fp32"),
    [
        ("avx512", "AuthenticAMD", "", True),  # MKL runs float32 at its AVX2 rate here
        ("avx512", "GenuineIntel", "", False),  # MKL runs AVX-512 on Intel
        ("avx2", "AuthenticAMD", "auto", False),
        (None, "AuthenticAMD", "", False),  # no native kernels
        ("avx512", "GenuineIntel", "native", True),
        ("avx2", "GenuineIntel", " Native ", True),
        ("avx512", "AuthenticAMD", "torch", False),
    ],
)
def test_who_multiplies_float32_weights(monkeypatch, isa, vendor, value, native_fp32) -> None:
    from tokenmill.native import dense16

    monkeypatch.setattr(native, "active_isa", lambda: isa)
    monkeypatch.setattr(native, "cpu_vendor", lambda: vendor)
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", value)
    assert dense16.fp32_native() is native_fp32


def test_native_float32_without_the_kernels_says_what_to_change(monkeypatch) -> None:
    from tokenmill.native import dense16

    monkeypatch.setattr(native, "active_isa", lambda: None)
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", "native")
    with pytest.raises(ValueError, match="TOKENMILL_FP32_GEMM=native needs"):
        dense16.fp32_native()
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", "mkl")
    with pytest.raises(ValueError, match="TOKENMILL_FP32_GEMM='mkl' is invalid: use auto"):
        dense16.fp32_native()


def test_the_cpu_vendor_is_read_from_cpuinfo() -> None:
    vendor = native.cpu_vendor()
    assert isinstance(vendor, str)
    if native.platform.machine() == "x86_64" and native._cpu_flags():
        assert vendor in ("GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls")
