"""Which tokens a Whisper row may emit next: suppression and the timestamp rules.

The timestamp rules are OpenAI Whisper's ``ApplyTimestampRules``: the text opens with a
timestamp, timestamps come in pairs (except right before eot) and never decrease, and a
timestamp is forced when their total probability beats every text token.
"""

from __future__ import annotations

import torch

MAX_INITIAL_TIMESTAMP = 50
"""The first timestamp is at most 1.0 s (50 x 0.02 s) into the window."""


def timestamp_mask(generated: list[int], ts_begin: int, eot: int, vocab: int) -> torch.Tensor:
    """[V] bool: the tokens the pair/monotonic rules forbid after ``generated``."""
    banned = torch.zeros(vocab, dtype=torch.bool)
    if not generated:
        banned[:ts_begin] = True
        banned[ts_begin + MAX_INITIAL_TIMESTAMP + 1 :] = True
        return banned
    last_ts = generated[-1] >= ts_begin
    penultimate_ts = len(generated) < 2 or generated[-2] >= ts_begin
    if last_ts:
        if penultimate_ts:
            banned[ts_begin:] = True  # a pair just closed: text (or eot) next
        else:
            banned[:eot] = True  # an opened pair: its closing timestamp or eot
    stamps = [t for t in generated if t >= ts_begin]
    if stamps:
        floor = stamps[-1] if last_ts and not penultimate_ts else stamps[-1] + 1
        banned[ts_begin:floor] = True
    return banned


def force_timestamps(logits: torch.Tensor, rows: torch.Tensor, ts_begin: int) -> torch.Tensor:
    """Where a row's timestamp mass beats its best text token, ban its text tokens.

    logits [B, V] (already masked); rows [B] bool: rows in timestamp mode.
    """
    logp = logits.float().log_softmax(-1)
    ts_mass = logp[:, ts_begin:].logsumexp(-1)
    best_text = logp[:, :ts_begin].max(-1).values
    force = rows & (ts_mass > best_text)
    text = torch.zeros_like(logits, dtype=torch.bool)
    text[:, :ts_begin] = True
    return logits.masked_fill(force[:, None] & text, float("-inf"))
