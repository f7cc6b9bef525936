"""Attention backends. The pure-PyTorch reference backend is the numerical oracle."""

from tokenmill.attention.metadata import AttentionMetadata, ForwardContext
from tokenmill.attention.reference import paged_attention, write_kv

__all__ = ["AttentionMetadata", "ForwardContext", "paged_attention", "write_kv"]
