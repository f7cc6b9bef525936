"""tokenizer.json rewritten into the form the ``tokenizers`` library parses fastest.

The same tokenizer, spelled for the Rust parser (Gemma3's 262k tokens and 515k merges,
measured on this 2-core machine, 1 thread: ~1.6 s -> ~1.1 s for ``Tokenizer.from_file``):

- no indentation: a pretty-printed file is a third whitespace;
- BPE merges as ``"a b"`` strings, the library's older spelling that it still reads,
  instead of ``["a", "b"]`` pairs: one string per merge to allocate instead of an array
  of two. Only where no piece holds a space (the split point); otherwise the pairs stay.

Nothing here interprets the tokenizer: the file is loaded by ``tokenizers`` as before, and
``hf_folder.save_fast`` keeps the rewritten file only when it loads back equal.
"""

from __future__ import annotations

import json
from typing import Any


def fast_tokenizer_json(text: str) -> str:
    """``text`` (a tokenizer.json) in its fastest-parsing spelling."""
    data = json.loads(text)
    model = data.get("model")
    if isinstance(model, dict) and model.get("type") == "BPE":
        model["merges"] = merges_as_strings(model.get("merges") or [])
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def merges_as_strings(merges: list[Any]) -> list[Any]:
    """``[["a", "b"], ...]`` -> ``["a b", ...]`` when every merge is such a pair and no piece
    holds a space; anything else unchanged (the library reads one spelling per list)."""
    if not all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges):
        return merges
    return [f"{a} {b}" for a, b in merges]
