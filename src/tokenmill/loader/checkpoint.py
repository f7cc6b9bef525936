"""The checkpoint a model is built from: its config and a stream of its weights."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tokenmill.errors import ModelLoadError


class WeightSource(Protocol):
    """Where a checkpoint's tensors come from.

    Contract: ``iter_weights(dtype)`` yields ``(HF parameter name, tensor)`` pairs,
    each tensor contiguous, on the CPU, in ``dtype``, and owning its memory (never a
    view into a memory-mapped file). At most one tensor is materialized at a time,
    so peak extra memory is one tensor, however big the checkpoint. Each call starts
    a fresh pass over the files. With ``keep_quantized``, a source that stores
    block-quantized tensors (GGUF) yields those as ``tokenmill.quant.GgufBlocks``
    instead (raw blocks, possibly a view of the file); others ignore the flag.
    """

    def iter_weights(
        self, dtype: torch.dtype, keep_quantized: bool = False
    ) -> Iterator[tuple[str, Any]]: ...


@dataclass(frozen=True)
class Checkpoint:
    """A resolved checkpoint. Build it with ``load_checkpoint``; treat the dicts as read-only."""

    path: str
    """The HF folder or the .gguf file."""
    format: str
    """"hf" or "gguf"."""
    hf_config: dict[str, Any]
    """Hugging Face ``config.json`` semantics, complete: transformers' ``to_dict()`` of the
    config class (defaults filled in, ``architectures`` set), plus the transformers-4 flat
    spellings ``rope_theta``/``rope_scaling`` (and ``rope_local_base_freq`` for Gemma3)."""
    generation_config: dict[str, Any] = field(default_factory=dict)
    """``generation_config.json`` semantics; {} when the checkpoint has none."""
    source: WeightSource | None = field(default=None, repr=False, compare=False)
    """Streams the tensors; None for a config-only Checkpoint built by hand."""

    def weights(
        self, dtype: torch.dtype, keep_quantized: bool = False
    ) -> Iterator[tuple[str, Any]]:
        """Stream (HF parameter name, tensor in ``dtype``), one tensor at a time
        (quantized GGUF tensors as raw blocks with ``keep_quantized``)."""
        if self.source is None:
            raise ModelLoadError(
                f"checkpoint {self.path} was built without a weight source; "
                "create it with tokenmill.loader.load_checkpoint(path)"
            )
        return self.source.iter_weights(dtype, keep_quantized)
