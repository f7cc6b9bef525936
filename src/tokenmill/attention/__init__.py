"""Attention backends and the step context. The pure-PyTorch reference backend is the
numerical oracle."""

from tokenmill.attention.backends import AttentionParams
from tokenmill.attention.context import ForwardContext, InputEmbeds, StepContext
from tokenmill.attention.metadata import AttentionMetadata, StateMetadata
from tokenmill.attention.reference import paged_attention, write_kv

__all__ = [
    "AttentionMetadata",
    "AttentionParams",
    "ForwardContext",
    "InputEmbeds",
    "StateMetadata",
    "StepContext",
    "paged_attention",
    "write_kv",
]
