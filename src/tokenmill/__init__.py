"""tokenmill: a portable LLM inference and serving engine on PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "StructuredOutputsParams",
    "__version__",
]

# Lazy: `import tokenmill` stays cheap (the CLI's --help must not import torch models).
_LAZY = {
    "LLM": "tokenmill.llm",
    "SamplingParams": "tokenmill.sampling_params",
    "RequestOutputKind": "tokenmill.sampling_params",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "Logprob": "tokenmill.outputs",
    "EngineConfig": "tokenmill.config",
    "StructuredOutputsParams": "tokenmill.structured_output.params",
}

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.llm import LLM
    from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
    from tokenmill.sampling_params import RequestOutputKind, SamplingParams
    from tokenmill.structured_output.params import StructuredOutputsParams


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
