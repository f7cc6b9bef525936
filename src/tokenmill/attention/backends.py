"""The attention backend contract, and the registry of backends (lazy imports).

A backend does one layer's paged attention for a flattened batch: it stores the new
K/V in the layer's cache, then attends over each sequence's blocks. A layer binds its
constants (scale, window, softcap, causal) once (``bind``); every step it passes only the
step's data. ``reference`` (pure PyTorch) is the numerical oracle; ``triton`` runs fused
kernels on CUDA; ``native`` runs the C kernels on CPU (float32, with rotary fused into
the K/V store). Nothing here imports triton: its backend module is imported only when
selected.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill import native
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.reference import paged_attention
from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenmill.layers.rotary import RopeTables

BACKENDS = {
    "reference": "tokenmill.attention.backends:ReferenceBackend",
    "triton": "tokenmill.attention.triton_backend:TritonBackend",
    "native": "tokenmill.attention.native_backend:NativeBackend",
}
"""Backend name -> "module:class"."""
BACKEND_CHOICES = ("auto", *BACKENDS)
"""What ``EngineConfig.attention_backend`` accepts; auto = triton on CUDA, native for a
quantized float32 model on CPU with the native kernels, else reference."""


@dataclass(frozen=True)
class AttentionParams:
    """One attention layer's constants, bound when the layer is built."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    """Multiplier of q.k (usually head_dim ** -0.5)."""
    sliding_window: int | None = None
    """Query at position p sees keys k with p - window < k <= p."""
    softcap: float | None = None
    """Scores become c * tanh(s / c)."""
    causal: bool = True
    """Query at position p sees keys k <= p (False: every key; no backend runs it yet)."""


class AttentionImpl(ABC):
    """A backend bound to one layer's constants: what the layer calls every step."""

    rotates: bool = False
    """True: the layer calls ``forward_packed`` instead, which applies rotary itself
    (fused with the K/V store)."""

    def __init__(self, params: AttentionParams) -> None:
        self.params = params

    @abstractmethod
    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D] and kv [T, 2, KVH, D] of the new tokens (views of the packed qkv
        projection are fine) -> output [T, H, D] in q's dtype.

        Stores kv into kv_cache [2, NB, BS, KVH, D] at ``meta.slot_mapping`` first, so the
        new tokens attend to themselves. Query token at absolute position p sees key
        positions k <= p, and with a sliding window w only k > p - w; a softcap c caps
        scores as c * tanh(s / c).
        """

    def forward_packed(
        self, qkv: torch.Tensor, rope: RopeTables, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``rotates`` backends: qkv [T, (H + 2 KVH) D] straight from the projection (q and
        k not rotated yet) -> output [T, H D]."""
        raise NotImplementedError


class AttentionBackend(ABC):
    """Paged attention. Stateless: one instance serves every layer through ``bind``."""

    name: str
    supports_cuda_graphs: bool = False
    """True when an all-decode ``forward`` reads the batch only from tensors (slot_mapping,
    block_tables, seq_lens_tensor) and never from the Python-side lengths, so one capture
    replays for any values. Padding rows (slot -1, seq_len 0) must store nothing and give
    zeros."""

    @abstractmethod
    def bind(self, params: AttentionParams) -> AttentionImpl:
        """This backend for one layer's constants."""


class ReferenceImpl(AttentionImpl):
    def forward(self, q, kv, kv_cache, meta):
        p = self.params
        return paged_attention(q, kv, kv_cache, meta, p.scale, p.sliding_window, p.softcap)


class ReferenceBackend(AttentionBackend):
    """Pure PyTorch (``attention/reference.py``): runs anywhere, the oracle of the others."""

    name = "reference"

    def bind(self, params: AttentionParams) -> AttentionImpl:
        return ReferenceImpl(params)


REFERENCE = ReferenceBackend()
"""The shared reference instance (the default of ``StepContext.backend``)."""


def select_backend(
    name: str, device: torch.device, dtype: torch.dtype | None = None, quantized: bool = False
) -> AttentionBackend:
    """The backend called ``name`` (one of ``BACKEND_CHOICES``) for a model on ``device``
    computing in ``dtype`` (None: not known yet) with quantized weights or not.

    Raises ``InvalidRequestError`` saying what to change when it can not run there.
    """
    name = resolve_backend_name(name, device, dtype, quantized)
    if name == "reference":
        return REFERENCE
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def resolve_backend_name(
    name: str, device: torch.device, dtype: torch.dtype | None = None, quantized: bool = False
) -> str:
    """``name`` with auto resolved, checked to run on ``device`` (and with ``dtype`` when
    given; ``InvalidRequestError`` otherwise); imports no backend module, so the config can
    check it before loading."""
    if name not in BACKEND_CHOICES:
        raise InvalidRequestError(
            f"attention_backend={name!r} is unknown; use one of {', '.join(BACKEND_CHOICES)}"
        )
    if name == "auto":
        name = _auto(device, dtype, quantized)
    if name == "triton":
        _check_triton(device)
    if name == "native":
        _check_native(device, dtype)
    return name


def _auto(device: torch.device, dtype: torch.dtype | None, quantized: bool) -> str:
    if device.type == "cuda":
        return "triton" if _triton_version() else "reference"
    # Dense float32 keeps the reference: its parity with transformers is exact.
    if quantized and dtype == torch.float32 and device.type == "cpu" and native.available():
        return "native"
    return "reference"


def _check_native(device: torch.device, dtype: torch.dtype | None) -> None:
    if device.type != "cpu":
        raise InvalidRequestError(
            f"attention_backend='native' runs on CPU, not on {device.type}: use 'auto'"
        )
    if not native.available():
        raise InvalidRequestError(
            "attention_backend='native' needs the native CPU kernels (x86-64 with "
            "AVX2+FMA+F16C and a C compiler); use attention_backend='reference'"
        )
    if dtype is not None and dtype != torch.float32:
        raise InvalidRequestError(
            f"attention_backend='native' computes in float32, the model computes in {dtype}: "
            "use dtype='float32' (or 'auto' with a GGUF model) or attention_backend='reference'"
        )


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def triton_interpreted() -> bool:
    """Whether Triton kernels run under its interpreter (``TRITON_INTERPRET=1``, read by
    triton when it is imported): on CPU tensors, with numpy, for tests."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def _check_triton(device: torch.device) -> None:
    if _triton_version() is None:
        raise InvalidRequestError(
            "attention_backend='triton' needs the triton package (pip install triton), "
            "or use attention_backend='reference'"
        )
    if device.type == "cuda":
        return
    if device.type == "cpu" and triton_interpreted():
        return  # the interpreter runs the kernels with numpy (tests only: slow)
    raise InvalidRequestError(
        f"attention_backend='triton' runs on CUDA, not on {device.type}: use "
        "attention_backend='reference' (or 'auto'), or set TRITON_INTERPRET=1 to run the "
        "kernels interpreted on CPU (slow, for tests)"
    )
