"""Checkpoint loading: Hugging Face folders (safetensors) and GGUF files, as one stream of
(HF parameter name, tensor)."""

from __future__ import annotations

from tokenmill.loader.checkpoint import Checkpoint, WeightSource
from tokenmill.loader.resolve import default_model_path, load_checkpoint

__all__ = ["Checkpoint", "WeightSource", "default_model_path", "load_checkpoint"]
