"""Structured output (guided decoding): constrain a request's tokens with a grammar.

``StructuredOutputsParams`` (on ``SamplingParams.structured_outputs``) says what the
output must be; a backend (``backend.py``; llguidance by default) compiles it; the
``StructuredOutputManager`` compiles off the engine loop, masks the logits of each
constrained row, and stops a request once its grammar is complete.
"""

from tokenmill.structured_output.params import GrammarSpec, StructuredOutputsParams

__all__ = ["GrammarSpec", "StructuredOutputsParams"]
