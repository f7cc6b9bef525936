"""Whisper's tokenizer and its special tokens, found by name in ``tokenizer.json``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

TIME_PRECISION = 0.02
"""Seconds per timestamp token."""


@dataclass(frozen=True)
class WhisperTokens:
    tokenizer: Tokenizer
    eot: int
    sot: int
    sot_prev: int
    no_timestamps: int
    transcribe: int | None
    translate: int | None
    languages: dict[str, int]
    """Language code -> token id (empty for English-only models' purposes too)."""
    multilingual: bool
    extra_suppress: tuple[int, ...]
    no_speech: int | None = None
    """<|nospeech|> (or <|nocaptions|> in older vocabularies): its probability right after
    the sot token says whether a window holds speech."""
    """Special tokens never generated as text (task, sot, prev, lm, nospeech)."""

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @classmethod
    def load(cls, folder: str | Path, multilingual: bool) -> WhisperTokens:
        tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))

        def tid(text: str) -> int | None:
            return tok.token_to_id(text)

        def need(text: str) -> int:
            i = tid(text)
            if i is None:
                raise ValueError(
                    f"{folder}/tokenizer.json has no {text!r}: not a Whisper tokenizer"
                )
            return i

        languages = {}
        for text, i in tok.get_vocab(with_added_tokens=True).items():
            m = re.fullmatch(r"<\|([a-z]{2,3}|haw|yue)\|>", text)
            if m:
                languages[m.group(1)] = i
        specials = ("<|transcribe|>", "<|translate|>", "<|startoftranscript|>", "<|startofprev|>",
                    "<|startoflm|>", "<|nospeech|>", "<|nocaptions|>")  # fmt: skip
        return cls(
            tokenizer=tok,
            eot=need("<|endoftext|>"),
            sot=need("<|startoftranscript|>"),
            sot_prev=need("<|startofprev|>"),
            no_timestamps=need("<|notimestamps|>"),
            transcribe=tid("<|transcribe|>"),
            translate=tid("<|translate|>"),
            languages=languages,
            multilingual=multilingual,
            extra_suppress=tuple(i for s in specials if (i := tid(s)) is not None),
            no_speech=tid("<|nospeech|>") or tid("<|nocaptions|>"),
        )

    def sot_sequence(self, language: str | None, task: str) -> list[int]:
        """[sot] for English-only models, [sot, <|lang|>, <|task|>] for multilingual ones."""
        if not self.multilingual:
            return [self.sot]
        lang = self.languages[language or "en"]
        task_id = self.translate if task == "translate" else self.transcribe
        assert task_id is not None
        return [self.sot, lang, task_id]

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i < self.eot])
