"""Text -> token ids for pooling, in batches, callable from many threads at once.

The fast path is the Rust tokenizer's ``encode_batch`` with truncation and padding off
(set once at load, never changed, so concurrent calls are safe). Truncation to k
tokens then keeps the special tokens: a single text keeps its head specials, the first
content tokens, and its tail specials, which is what the HF tokenizer's
``truncation=True, max_length=k`` gives. Pairs that need cutting go through the HF
tokenizer (``longest_first``) under a lock, since it reconfigures the backend per call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from tokenmill.errors import ContextLengthError, InvalidRequestError


@dataclass(frozen=True)
class Encoded:
    """One tokenized input: token ids and (for pairs) their segment ids."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


class PoolingTokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, max_len: int) -> None:
        self.hf = hf
        self.max_len = max_len
        # A private copy: HF tokenizer calls (``llm.get_tokenizer()(..., padding=True)``)
        # reconfigure the backend they share, which must never reach this one.
        self.backend = Tokenizer.from_str(hf.backend_tokenizer.to_str())
        self.backend.no_truncation()
        self.backend.no_padding()
        self._lock = threading.Lock()
        full = self.backend.encode("a", add_special_tokens=True).ids
        bare = self.backend.encode("a", add_special_tokens=False).ids
        self.num_head = next((i for i in range(len(full)) if full[i : i + len(bare)] == bare), 0)
        self.num_tail = len(full) - self.num_head - len(bare)

    def limit(self, truncate: int | None) -> int | None:
        """The token count a request keeps: None (no cutting), or k <= max_len."""
        if truncate is None:
            return None
        if truncate == -1 or truncate > self.max_len:
            return self.max_len
        if truncate < self.num_head + self.num_tail + 1:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={truncate} leaves no room for text next to the "
                f"{self.num_head + self.num_tail} special tokens"
            )
        return truncate

    def encode(self, texts: Sequence[str], truncate: int | None) -> list[Encoded]:
        """Each text -> ids with special tokens, cut to ``limit(truncate)``; over
        max_len without truncation raises ContextLengthError."""
        for text in texts:
            if not isinstance(text, str):
                raise InvalidRequestError(f"each input must be a string, got {type(text).__name__}")
            if not text:
                raise InvalidRequestError("an input is an empty string; send some text")
        keep = self.limit(truncate)
        out = []
        for enc in self.backend.encode_batch(list(texts), add_special_tokens=True):
            ids = enc.ids
            if keep is not None and len(ids) > keep:
                cut = keep - self.num_tail
                ids = ids[:cut] + ids[len(ids) - self.num_tail :]
            out.append(Encoded(self.check_len(ids, truncate)))
        return out

    def encode_pairs(
        self, firsts: Sequence[str], seconds: Sequence[str], truncate: int | None
    ) -> list[Encoded]:
        """(query, document) pairs as one sequence with segment ids (cross-encoders)."""
        if any(not a for a in firsts) or any(not b for b in seconds):
            raise InvalidRequestError("a text to score is an empty string; send some text")
        keep = self.limit(truncate)
        pairs = list(zip(firsts, seconds, strict=True))
        encs = self.backend.encode_batch(pairs, add_special_tokens=True)
        out = []
        for (a, b), enc in zip(pairs, encs, strict=True):
            ids, types = enc.ids, enc.type_ids
            if keep is not None and len(ids) > keep:
                with self._lock:
                    cut = self.hf(a, b, truncation="longest_first", max_length=keep)
                ids, types = list(cut["input_ids"]), list(cut["token_type_ids"])
            out.append(Encoded(self.check_len(ids, truncate), list(types)))
        return out

    def from_ids(self, token_ids: Sequence[int], truncate: int | None) -> Encoded:
        """Token ids given by the caller; truncation keeps the last ones (as vLLM)."""
        ids = list(token_ids)
        if not ids:
            raise InvalidRequestError("an input has no token ids; send at least one")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < len(self.hf)]
        if bad:
            raise InvalidRequestError(f"token ids must be in [0, {len(self.hf)}); got {bad[:5]}")
        keep = self.limit(truncate)
        if keep is not None:
            ids = ids[-keep:]
        return Encoded(self.check_len(ids, truncate))

    def check_len(self, ids: list[int], truncate: int | None) -> list[int]:
        if len(ids) > self.max_len:
            hint = "" if truncate is not None else "; pass truncate_prompt_tokens=-1 to cut it"
            raise ContextLengthError(
                f"an input has {len(ids)} tokens, over this model's limit of {self.max_len}{hint}"
            )
        return ids
