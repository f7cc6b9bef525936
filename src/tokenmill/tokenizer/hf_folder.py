"""A HF tokenizer folder: loaded (the generic class without AutoTokenizer's lookup), and
saved in the form that loads fastest when that form loads back the same tokenizer.

Where ``from_pretrained`` spends its time on a saved fast tokenizer (Gemma3: a 33 MB
tokenizer.json, 262k tokens, 6384 added tokens, 515k merges; seconds on this 2-core machine):

- the Rust parse of tokenizer.json (~1.6 s as ``save_pretrained`` writes it, ~1.1 s in the
  spelling of ``fast_json``); the merges are most of it (~0.9 s), then the vocabulary;
- without ``added_tokens_decoder`` in tokenizer_config.json (transformers 5 does not save
  it), a second parse of the whole tokenizer.json in Python, only to read its added tokens
  (~0.8 s); with all of them listed, a ``deepcopy`` of the 6384 in ``__init__`` (~0.4 s);
- a model-specific class (``GemmaTokenizer``) re-extracts the vocabulary and merges in
  Python and rebuilds its pipeline (~1.6 s), although tokenizer.json already holds it;
- ``AutoTokenizer`` itself indexes every model package to resolve the class (~0.6 s).

``save_fast`` writes the folder with the generic class, tokenizer.json in the spelling of
``fast_json`` and, in ``added_tokens_decoder``, only the added tokens that name a special
token (the rest are in tokenizer.json, which the Rust parser reads anyway; a present entry
is what stops the Python parse), then keeps that form only when the folder loads back
equal to the tokenizer it saved (``differences`` on a probe set); otherwise the folder
stays as ``save_pretrained`` wrote it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from tokenmill.tokenizer.fast_json import fast_tokenizer_json

logger = logging.getLogger(__name__)

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""``tokenizer_class`` names of transformers' generic fast tokenizer (one class in 5.x)."""

_CONFIG, _JSON = "tokenizer_config.json", "tokenizer.json"

PROBES = (
    "",
    "Hello world",
    " The capital of France is",
    "  leading spaces,\ttabs\n\nand  double  spaces ",
    "Ünïcode: 日本語のテキスト, 한국어, العربية, emoji 🤖🎉",
    "def f(x):\n    return x ** 2  # code\n",
    "numbers 1234567890 3.14159 -42 1e-5",
    "<bos><eos><pad><unk></s><s><|endoftext|><|im_start|>user<|im_end|>",
    "<start_of_turn>model\nhi<end_of_turn>",
    "a" * 64,
)
"""Texts the fast form must tokenize exactly as the original: spaces, scripts, code,
digits and the special-token spellings of the families we load."""


def load_hf_folder(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``folder`` (raises OSError, ValueError, or the bare Exception of
    the Rust parser for a broken tokenizer.json)."""
    if generic_class(folder):  # the class AutoTokenizer would pick, without its lookup
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def generic_class(folder: Path) -> bool:
    """Whether the folder's tokenizer is transformers' generic fast tokenizer over its
    tokenizer.json (what ``save_fast`` writes when it can)."""
    try:
        config = json.loads((folder / _CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict)
        and config.get("tokenizer_class") in GENERIC_CLASSES
        and (folder / _JSON).is_file()
    )


def save_fast(tokenizer: PreTrainedTokenizerBase, folder: Path) -> bool:
    """Save ``tokenizer`` into ``folder``; True when the fast form was kept."""
    tokenizer.save_pretrained(str(folder))
    paths = (folder / _CONFIG, folder / _JSON)
    if not all(p.is_file() for p in paths):
        return False  # not a tokenizers-backed tokenizer: nothing to gain
    original = [p.read_text() for p in paths]
    config = json.loads(original[0])
    source_class = config.get("tokenizer_class")
    fast = [_fast_config(tokenizer, config), fast_tokenizer_json(original[1])]
    for path, text in zip(paths, fast, strict=True):
        path.write_text(text)
    try:
        problems = differences(tokenizer, load_hf_folder(folder))
    except Exception as e:  # noqa: BLE001 - whatever fails to load keeps the saved form
        problems = [f"it does not load ({e})"]
    if problems:
        for path, text in zip(paths, original, strict=True):
            path.write_text(text)
        logger.info("tokenizer kept as %s: the generic form differs (%s)", source_class,
                    problems[0])  # fmt: skip
        return False
    return True


def _fast_config(tokenizer: PreTrainedTokenizerBase, config: dict[str, Any]) -> str:
    """tokenizer_config.json of the generic class, listing the added tokens that are special
    token attributes (``bos_token``, ...): transformers maps those to their ``AddedToken``."""
    config = dict(config, tokenizer_class="TokenizersBackend")
    # class defaults the saved config leaves out (GemmaTokenizer pads on the left)
    config.update(padding_side=tokenizer.padding_side, truncation_side=tokenizer.truncation_side)
    named = set(tokenizer.all_special_tokens)
    config["added_tokens_decoder"] = {
        str(i): token.__getstate__()
        for i, token in tokenizer.added_tokens_decoder.items()
        if str(token) in named
    }
    return json.dumps(config, indent=2, ensure_ascii=False)


def differences(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> list[str]:
    """What tells ``b`` from ``a`` on the probe set (empty: the same tokenizer for us)."""
    found = [f"{name}: {x!r} != {y!r}" for name, x, y in _attributes(a, b) if x != y]
    for text in PROBES:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)
            if b.encode(text, add_special_tokens=special) != ids:
                found.append(f"encode({text!r}, add_special_tokens={special})")
            if b.decode(ids, skip_special_tokens=special) != a.decode(
                ids, skip_special_tokens=special
            ):
                found.append(f"decode of {text!r}, skip_special_tokens={special}")
    if a.chat_template and _chat(a) != _chat(b):
        found.append("the rendered chat template")
    if _pipeline(a) != _pipeline(b):
        found.append("the tokenizers pipeline (its JSON as the library writes it back)")
    return found


def _pipeline(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The Rust tokenizer as its library serializes it: model, vocabulary, merges, added
    tokens, normalizer, pre-tokenizer, post-processor, decoder (~0.2 s for Gemma3's)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.to_str() if backend is not None else None


def _attributes(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> list[tuple]:
    sample = range(0, len(a), max(1, len(a) // 997))  # ~1000 ids spread over the vocabulary
    return [
        (name, get(a), get(b))
        for name, get in (
            ("len", len),
            ("special ids", lambda t: t.all_special_ids),
            ("special tokens", lambda t: t.all_special_tokens),
            (
                "bos/eos/pad/unk",
                lambda t: (t.bos_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id),
            ),  # fmt: skip
            ("added tokens", lambda t: {i: str(v) for i, v in t.added_tokens_decoder.items()}),
            ("chat template", lambda t: t.chat_template),
            ("sides", lambda t: (t.padding_side, t.truncation_side, t.model_max_length)),
            ("tokens", lambda t: t.convert_ids_to_tokens(list(sample))),
        )
    ]


def _chat(tokenizer: PreTrainedTokenizerBase) -> Any:
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "2 + 2?"}]  # fmt: skip
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template that can not render these: the same error both ways
        return f"{type(e).__name__}: {e}"
