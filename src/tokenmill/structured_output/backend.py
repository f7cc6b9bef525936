"""The grammar backend contract, and the registry of backends (lazy imports).

A backend turns a ``GrammarSpec`` into a ``CompiledGrammar`` for one tokenizer
(slow: done off the engine loop, cached by spec), and a compiled grammar hands
out fresh per-request ``GrammarMatcher``s (cheap). Per step, a matcher fills its
row of a token bitmask; after sampling it accepts the token; for speculative
tokens it can roll back.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output.limits import GrammarLimits
from tokenmill.structured_output.params import GrammarSpec

BACKENDS = {
    "guidance": "tokenmill.structured_output.guidance:GuidanceBackend",
}
"""Backend name -> "module:class". ``auto`` picks the first one that is installed."""
BACKEND_CHOICES = ("auto", *BACKENDS)


class GrammarMatcher(ABC):
    """One request's position in its grammar.

    Bit ``t % 32`` of ``bitmask[row, t // 32]`` set = token t allowed next. When the
    grammar is complete (``is_terminated``), only EOS is allowed.
    """

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [N, ceil(V/32)], CPU)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    @abstractmethod
    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the grammar allows in turn, without
        advancing (a rejected ``accept_token`` leaves a matcher in error: drafts are
        checked here first)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more: the request should stop."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """What was generated so far is a complete match (EOS would be allowed)."""


class CompiledGrammar(ABC):
    """A grammar compiled for one tokenizer; shared by every request with its spec."""

    cost_bytes: int = 0
    """Estimated memory it holds (set by the manager after compiling it)."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""


class StructuredOutputBackend(ABC):
    """Compiles specs for one tokenizer. Thread-safe: ``compile`` runs in a pool."""

    name: str

    @abstractmethod
    def validate(self, spec: GrammarSpec) -> None:
        """Raise ``InvalidRequestError`` naming the problem if ``spec`` can not compile.

        Fast (no tokenizer work): called when a request is added.
        """

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Build the grammar for this tokenizer (may take long: called off the engine loop)."""

    @property
    @abstractmethod
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab / 32)."""

    def fill_bitmasks(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor
    ) -> None:
        """Fill ``bitmask[row]`` for every (matcher, row); backends may do it in parallel."""
        for matcher, row in matchers:
            matcher.fill_bitmask(bitmask, row)


def create_backend(
    name: str,
    hf_tokenizer,
    vocab_size: int,
    eos_token_ids: Iterable[int],
    limits: GrammarLimits | None = None,
) -> StructuredOutputBackend:
    """The backend called ``name`` (or the first installed one for ``auto``); ``limits``
    bound what its native compiler may build (lexer states, row sizes)."""
    if name not in BACKEND_CHOICES:
        raise InvalidRequestError(
            f"structured_outputs_backend={name!r} is unknown; use one of {', '.join(BACKEND_CHOICES)}"
        )
    candidates = list(BACKENDS) if name == "auto" else [name]
    errors = []
    for candidate in candidates:
        module, cls = BACKENDS[candidate].split(":")
        try:
            backend_cls = getattr(importlib.import_module(module), cls)
        except ImportError as e:
            errors.append(f"{candidate}: {e}")
            continue
        return backend_cls(hf_tokenizer, vocab_size, list(eos_token_ids), limits)
    raise InvalidRequestError(
        "no structured output backend is installed ("
        + "; ".join(errors)
        + "); pip install llguidance"
    )
