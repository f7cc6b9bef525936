"""Raw bytes of one vocabulary entry, for logprobs (``bytes`` of OpenAI's logprob objects).

Which spelling a vocabulary uses follows from its ``tokenizers`` decoder: byte-level BPE
writes each byte as one printable character (GPT-2's table), SentencePiece writes a
space as ``▁`` and unencodable bytes as ``<0xNN>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

SP_SPACE = "\u2581"
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

TokenToBytes = Callable[[str], bytes]


@lru_cache(maxsize=1)
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, character -> byte direction."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def byte_level_bytes(token: str) -> bytes:
    table = gpt2_byte_decoder()
    if all(c in table for c in token):
        return bytes(table[c] for c in token)
    return token.encode("utf-8")  # an added token written in plain text


def sentencepiece_bytes(token: str) -> bytes:
    match = _SP_BYTE.fullmatch(token)
    if match:
        return bytes([int(match[1], 16)])
    return token.replace(SP_SPACE, " ").encode("utf-8")


# tokenizers decoder type -> spelling of its vocabulary.
SPELLINGS: dict[str, TokenToBytes] = {
    "ByteLevel": byte_level_bytes,
    "ByteFallback": sentencepiece_bytes,
    "Metaspace": sentencepiece_bytes,
}


def spelling_of(backend_decoder: Any) -> TokenToBytes | None:
    """The byte spelling of a ``tokenizers`` decoder, None when it is none of the known ones."""
    if backend_decoder is None:
        return None
    state = json.loads(backend_decoder.__getstate__())
    return next((SPELLINGS[t] for t in _types(state) if t in SPELLINGS), None)


def _types(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            yield node["type"]
        for child in node.get("decoders") or ():
            yield from _types(child)
