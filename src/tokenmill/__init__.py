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
    "GuidedDecodingParams",
    "EngineArgs",
    "TextPrompt",
    "TokensPrompt",
    "TTS",
    "AudioParams",
    "Transcriber",
    "load_model",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ScoringRequestOutput",
    "ClassificationRequestOutput",
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
    "EngineArgs": "tokenmill.entrypoints.engine_args",  # vLLM's CLI-facing options object
    "TextPrompt": "tokenmill.inputs",
    "TokensPrompt": "tokenmill.inputs",
    "TTS": "tokenmill.speech.tts",
    "AudioParams": "tokenmill.speech.tts",
    "Transcriber": "tokenmill.speech.transcriber",
    "load_model": "tokenmill.speech.runtime",
    "PoolingParams": "tokenmill.pooling.params",
    "PoolingRequestOutput": "tokenmill.pooling.outputs",
    "EmbeddingRequestOutput": "tokenmill.pooling.outputs",
    "ScoringRequestOutput": "tokenmill.pooling.outputs",
    "ClassificationRequestOutput": "tokenmill.pooling.outputs",
}
_ALIASES = {"GuidedDecodingParams": "StructuredOutputsParams"}
"""vLLM's older names."""

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.entrypoints.engine_args import EngineArgs
    from tokenmill.inputs import TextPrompt, TokensPrompt
    from tokenmill.llm import LLM
    from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
    from tokenmill.pooling.outputs import (
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        ScoringRequestOutput,
    )
    from tokenmill.pooling.params import PoolingParams
    from tokenmill.sampling_params import RequestOutputKind, SamplingParams
    from tokenmill.speech.runtime import load_model
    from tokenmill.speech.transcriber import Transcriber
    from tokenmill.speech.tts import TTS, AudioParams
    from tokenmill.structured_output.params import StructuredOutputsParams
    from tokenmill.structured_output.params import (
        StructuredOutputsParams as GuidedDecodingParams,
    )


def __getattr__(name: str):
    name = _ALIASES.get(name, name)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
