"""Speculative decoding: proposers of draft tokens, attached to the engine as a hook."""

from tokenmill.spec_decode.proposer import DraftHook, Proposer

__all__ = ["DraftHook", "Proposer"]
