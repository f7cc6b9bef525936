"""Choosing an attention backend: names, devices, and the errors that say what to change."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tokenmill.attention import AttentionMetadata, ForwardContext
from tokenmill.attention.backends import (
    BACKEND_CHOICES,
    REFERENCE,
    resolve_backend_name,
    select_backend,
)
from tokenmill.config import EngineConfig
from tokenmill.entrypoints.args import ENGINE_FLAGS
from tokenmill.errors import InvalidRequestError
from tokenmill.layers.ops import DEFAULT_OPS, select_ops

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_unknown_name_lists_the_choices():
    with pytest.raises(InvalidRequestError, match="auto, reference, triton"):
        select_backend("flash", CPU)
    with pytest.raises(InvalidRequestError, match="attention_backend='flash'"):
        EngineConfig(attention_backend="flash")


def test_reference_and_auto_on_cpu():
    assert select_backend("reference", CPU) is REFERENCE
    assert select_backend("auto", CPU) is REFERENCE
    assert select_backend("reference", CUDA) is REFERENCE


def test_context_defaults_to_reference():
    """A step context without a backend leaves each layer the one it was built with, and a
    layer (or model) built without a selection runs the reference."""
    meta = AttentionMetadata.build([1], [1], [[0]], 4)
    assert ForwardContext(meta, []).backend is None
    assert DEFAULT_OPS.backend is REFERENCE
    assert select_ops(CPU, torch.float32).backend is REFERENCE


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidRequestError, match="TRITON_INTERPRET=1"):
        select_backend("triton", CPU)
    with pytest.raises(InvalidRequestError, match="runs on CUDA"):
        EngineConfig(attention_backend="triton", device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("triton", CPU) == "triton"


def test_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    with pytest.raises(InvalidRequestError, match="needs the triton package"):
        select_backend("triton", CUDA)
    assert select_backend("auto", CUDA) is REFERENCE


def test_auto_on_cuda_is_triton_when_installed():
    pytest.importorskip("triton")
    assert resolve_backend_name("auto", CUDA) == "triton"


def test_only_triton_is_capturable():
    pytest.importorskip("triton")
    # no env change here: it would turn the kernels interpreted on a CUDA machine
    device = CUDA if torch.cuda.is_available() else CPU  # conftest: interpreted on CPU
    assert select_backend("triton", device).supports_cuda_graphs
    assert not REFERENCE.supports_cuda_graphs


def test_cli_flag_matches_the_registry():
    (flag,) = [f for f in ENGINE_FLAGS if f.dest == "attention_backend"]
    assert flag.choices == BACKEND_CHOICES and flag.default == EngineConfig.attention_backend


def test_importing_tokenmill_does_not_import_triton():
    code = (
        "import sys, tokenmill, tokenmill.llm, tokenmill.engine.engine, tokenmill.layers.attention; "
        "from tokenmill.attention.backends import select_backend; "
        "select_backend('auto', __import__('torch').device('cpu')); "
        "assert 'triton' not in sys.modules, 'triton was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
