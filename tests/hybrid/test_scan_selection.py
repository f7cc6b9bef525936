"""Which scan kernels a hybrid model gets (``layers/recurrent/scan.select_scan``, once at
load, in the load log), ``TOKENMILL_SCAN_KERNEL``, and the same greedy tokens from a model
whichever kernels it runs: native (CPU default), the PyTorch reference, Triton
(interpreted here)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from hybrid_checkpoints import (
    hybrid_llm,
    make_mamba2,
    make_qwen3_5,
    random_prompts,
    tokenmill_greedy,
)

from tokenmill import native
from tokenmill.layers.recurrent.scan import select_scan

CPU = torch.device("cpu")


def test_cpu_takes_native_where_it_builds(native_isa):
    assert select_scan(CPU).name == ("torch" if native_isa == "fallback" else "native")


def test_cuda_without_triton_takes_the_reference(monkeypatch):
    import tokenmill.layers.recurrent as package

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    monkeypatch.delitem(sys.modules, "tokenmill.layers.recurrent.triton_scan", raising=False)
    monkeypatch.delattr(package, "triton_scan", raising=False)  # as if never imported
    monkeypatch.delenv("TOKENMILL_SCAN_KERNEL", raising=False)
    assert select_scan(torch.device("cuda")).name == "torch"


def test_the_environment_forces_a_kernel(monkeypatch):
    monkeypatch.setenv("TOKENMILL_SCAN_KERNEL", "torch")
    assert select_scan(CPU).name == "torch"
    monkeypatch.setenv("TOKENMILL_SCAN_KERNEL", "native")
    with native.use(None), pytest.raises(ValueError, match="TOKENMILL_SCAN_KERNEL=native"):
        select_scan(CPU)
    monkeypatch.setenv("TOKENMILL_SCAN_KERNEL", "fast")
    with pytest.raises(ValueError, match="TOKENMILL_SCAN_KERNEL='fast' is invalid"):
        select_scan(CPU)


def test_selecting_on_cpu_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from tokenmill.layers.ops import select_ops\n"
        "assert select_ops('cpu', torch.float32).scan.name in ('native', 'torch')\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_scan"), smollm2_hf_tokenizer)


@pytest.fixture(scope="module")
def mamba2_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_mamba2(tmp_path_factory.mktemp("mamba2_scan"), smollm2_hf_tokenizer)


def _greedy(path, monkeypatch, kernel: str, steps: int = 12):
    """Chunked prefill (16-token steps) next to decodes: the sequence scans and the steps."""
    monkeypatch.setenv("TOKENMILL_SCAN_KERNEL", kernel)
    llm = hybrid_llm(path, max_model_len=160, max_num_batched_tokens=16, max_num_seqs=4)
    assert all(getattr(m, "scan", None) is None or m.scan.name == kernel
               for m in llm.engine.runner.model.modules())  # fmt: skip
    results = tokenmill_greedy(llm, random_prompts(4, seed=5, longest=30), steps)
    llm.close()
    return results


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_every_kernel_gives_the_reference_tokens(
    family, qwen35_dir, mamba2_dir, monkeypatch, caplog
):
    path = qwen35_dir if family == "qwen3_5" else mamba2_dir
    want = _greedy(path, monkeypatch, "torch")
    kernels = ["native"] if native.available() else []
    try:
        import triton  # noqa: F401

        from tokenmill.attention.backends import triton_interpreted

        kernels += ["triton"] if triton_interpreted() else []
    except ImportError:
        pass
    for kernel in kernels:
        # the load log's own logger: `tokenmill serve` (run in-process by earlier tests)
        # raises tokenmill.engine's level to WARNING
        with caplog.at_level(logging.INFO, logger="tokenmill.engine.loading"):
            got = _greedy(path, monkeypatch, kernel)
        assert f"recurrent scans {kernel}" in caplog.text
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
            assert tokens == want_tokens
            torch.testing.assert_close(logprobs, want_logprobs, atol=1e-4, rtol=0)
