"""Tokenizers of GGUF files: converted once by transformers, then cached as a HF folder.

Conversion builds the whole BPE/SentencePiece model from the metadata (SmolLM2 ~6 s,
Gemma3 ~20 s on two cores); loading the saved ``tokenizer.json`` takes well under a
second. The cache key covers everything the conversion depends on: the file (path,
size, mtime) and the transformers version that converted it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenmill.env import cache_dir
from tokenmill.tokenizer.hf_folder import load_hf_folder, save_fast

logger = logging.getLogger(__name__)

_FORMAT_VERSION = "3"  # bump when what we save changes (2: the fast form, hf_folder.save_fast;
# 3: its compact tokenizer.json and short added_tokens_decoder)
_COMPLETE_MARK = "tokenizer_config.json"


def cache_path(gguf_path: Path) -> Path:
    """Folder the converted tokenizer of ``gguf_path`` is (or will be) saved in."""
    import transformers

    stat = gguf_path.stat()
    key = "|".join(
        (_FORMAT_VERSION, str(gguf_path.resolve()), str(stat.st_size), str(stat.st_mtime_ns),
         transformers.__version__)
    )  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_dir() / "tokenizers" / f"{gguf_path.stem}-{digest}"


def cached_folder(tokenizer: PreTrainedTokenizerBase) -> Path | None:
    """The cache folder ``tokenizer`` was loaded from (a GGUF's converted tokenizer, saved
    in the fast form), or None: a copy of its files loads the same tokenizer."""
    folder = Path(tokenizer.name_or_path)
    cached = folder.parent == cache_dir() / "tokenizers" and (folder / _COMPLETE_MARK).is_file()
    return folder if cached else None


def load_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file, from the cache when it is there."""
    cached = cache_path(gguf_path)
    if (cached / _COMPLETE_MARK).is_file():
        try:
            return load_hf_folder(cached)
        except Exception as e:  # noqa: BLE001 - a damaged entry (the Rust parser raises a bare Exception): convert again
            logger.warning("ignoring damaged tokenizer cache %s: %s", cached, e)
    tokenizer = convert_gguf_tokenizer(gguf_path)
    _save(tokenizer, cached)
    return tokenizer


def convert_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    start = time.perf_counter()
    logger.info("converting the tokenizer of %s (cached afterwards)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    logger.info("tokenizer converted in %.1f s", time.perf_counter() - start)
    return tokenizer


def _save(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save into a temporary sibling, then rename: readers never see a half-written folder."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as e:
        _warn_not_cached(target, e)
        return
    try:
        save_fast(tokenizer, tmp)
        shutil.rmtree(target, ignore_errors=True)  # a damaged entry
        os.replace(tmp, target)
    except OSError as e:
        if not (target / _COMPLETE_MARK).is_file():  # else another process saved it first
            _warn_not_cached(target, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _warn_not_cached(target: Path, error: OSError) -> None:
    logger.warning(
        "could not cache the converted tokenizer in %s (%s); set TOKENMILL_CACHE_DIR to a "
        "writable folder to make the next start fast",
        target,
        error,
    )
