"""Speculative decoding: proposers of draft tokens, attached to the engine as a hook.

``registry.build_draft_hook`` makes the engine's hook from its ``SpeculativeConfig``: the method's
proposer (``PROPOSERS``, imported lazily), and the draft-length chooser with the verify
cost measured on the engine's own runner.
"""

from tokenmill.spec_decode.config import SpeculativeConfig, resolve_speculative
from tokenmill.spec_decode.proposer import DraftHook, Proposer

__all__ = [
    "DraftHook",
    "Proposer",
    "SpeculativeConfig",
    "resolve_speculative",
]
