"""Which tokens a Whisper row may emit next: suppression and the timestamp rules.

The timestamp rules are OpenAI Whisper's ``ApplyTimestampRules``: the text opens with a
timestamp, timestamps come in pairs (except right before eot) and never decrease, and a
timestamp is forced when their total probability beats every text token.
"""

from __future__ import annotations

import torch

MAX_INITIAL_TIMESTAMP = 50
"""The first timestamp is at most 1.0 s (50 x 0.02 s) into the window."""


def timestamp_bans(generated: list[int], ts_begin: int, eot: int) -> list[tuple[int, int | None]]:
    """Token ranges [lo, hi) (hi None: to the vocabulary's end) the pair/monotonic rules
    forbid after ``generated``: a few slices to fill, not a [V] mask per row and step."""
    if not generated:
        return [(0, ts_begin), (ts_begin + MAX_INITIAL_TIMESTAMP + 1, None)]
    bans: list[tuple[int, int | None]] = []
    last_ts = generated[-1] >= ts_begin
    penultimate_ts = len(generated) < 2 or generated[-2] >= ts_begin
    if last_ts:
        if penultimate_ts:
            bans.append((ts_begin, None))  # a pair just closed: text (or eot) next
        else:
            bans.append((0, eot))  # an opened pair: its closing timestamp or eot
    stamps = [t for t in generated if t >= ts_begin]
    if stamps:
        floor = stamps[-1] if last_ts and not penultimate_ts else stamps[-1] + 1
        bans.append((ts_begin, floor))
    return bans


def timestamp_mask(generated: list[int], ts_begin: int, eot: int, vocab: int) -> torch.Tensor:
    """[V] bool: the tokens the pair/monotonic rules forbid after ``generated``."""
    banned = torch.zeros(vocab, dtype=torch.bool)
    for lo, hi in timestamp_bans(generated, ts_begin, eot):
        banned[lo:hi] = True
    return banned


def force_timestamps_(
    logits: torch.Tensor, logp: torch.Tensor, rows: list[int], ts_begin: int
) -> None:
    """Where a row's timestamp mass beats its best text token, ban its text tokens.

    logits [B, V] float32 (already masked) and their log_softmax ``logp``, both updated in
    place; ``rows``: the rows in timestamp mode.
    """
    if not rows:
        return
    sel = logp[rows]  # [R, V]
    ts_mass = sel[:, ts_begin:].logsumexp(-1)
    best_text = sel[:, :ts_begin].max(-1).values
    for b, force in zip(rows, (ts_mass > best_text).tolist()):
        if force:
            logits[b, :ts_begin] = float("-inf")
            logp[b] = logits[b].log_softmax(-1)
