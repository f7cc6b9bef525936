"""The attention backend contract, and the registry of backends (lazy imports).

A backend does one layer's paged attention for a flattened batch: it stores the new
K/V in the layer's cache, then attends over each sequence's blocks. ``reference``
(pure PyTorch) is the numerical oracle; ``triton`` runs fused kernels on CUDA.
Nothing here imports triton: its backend module is imported only when selected.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.errors import InvalidRequestError

BACKENDS = {
    "reference": "tokenmill.attention.backends:ReferenceBackend",
    "triton": "tokenmill.attention.triton_backend:TritonBackend",
}
"""Backend name -> "module:class"."""
BACKEND_CHOICES = ("auto", *BACKENDS)
"""What ``EngineConfig.attention_backend`` accepts; auto = triton on CUDA, else reference."""


class AttentionBackend(ABC):
    """Paged attention of one layer. Stateless: one instance serves every layer."""

    name: str
    supports_cuda_graphs: bool = False
    """True when an all-decode ``forward`` reads the batch only from tensors (slot_mapping,
    block_tables, seq_lens_tensor) and never from the Python-side lengths, so one capture
    replays for any values. Padding rows (slot -1, seq_len 0) must store nothing and give
    zeros."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] and kv [T, 2, KVH, D] of the new tokens (views of the packed qkv
        projection are fine) -> output [T, H, D] in q's dtype.

        Stores kv into kv_cache [2, NB, BS, KVH, D] at ``meta.slot_mapping`` first, so the
        new tokens attend to themselves. Query token at absolute position p sees key
        positions k <= p, and with a sliding window w only k > p - w; ``softcap`` c caps
        scores as c * tanh(s / c).
        """


class ReferenceBackend(AttentionBackend):
    """Pure PyTorch (``attention/reference.py``): runs anywhere, the oracle of the others."""

    name = "reference"

    def forward(self, q, kv, kv_cache, meta, scale, sliding_window=None, softcap=None):
        from tokenmill.attention.reference import paged_attention

        return paged_attention(q, kv, kv_cache, meta, scale, sliding_window, softcap)


REFERENCE = ReferenceBackend()
"""The shared reference instance (the default of ``ForwardContext.backend``)."""


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` (one of ``BACKEND_CHOICES``) for a model on ``device``.

    Raises ``InvalidRequestError`` saying what to change when it can not run there.
    """
    name = resolve_backend_name(name, device)
    if name == "reference":
        return REFERENCE
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``name`` with auto resolved, checked to run on ``device`` (``InvalidRequestError``
    otherwise); imports no backend, so the config can check it before loading."""
    if name not in BACKEND_CHOICES:
        raise InvalidRequestError(
            f"attention_backend={name!r} is unknown; use one of {', '.join(BACKEND_CHOICES)}"
        )
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_version() else "reference"
    if name == "triton":
        _check_triton(device)
    return name


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
