"""Penalty histories on the device: per live request, its output-token counts [V] and
its prompt's token set [V], kept across steps and updated with the new tokens only.

Rebuilding the counts from the token lists every step costs O(output length) of Python
per penalised row per step (a padded [S, L] list, then a scatter); here a request's row
is filled once, when it is first sampled, and each step adds the tokens that reached the
host since (one batched ``index_put_`` for the whole step, usually one token per row).

A row belongs to a request object (the scheduler's ``Request``; the sampler sees it as a
row, or as an ``InFlightRow`` around it) and is given back when the request has finished
or been garbage-collected. Rows that are not live requests (a draft position's
``RowState``, rows built by hand in tests) are counted from their lists, as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.sampling.logits_processors import upload


@dataclass
class _Entry:
    row: int
    counted: int
    """How many of the request's outputs the row's counts include (a prefix)."""
    owner: weakref.ref


class PenaltyHistories:
    """A pool of rows: ``counts`` [P, V] float32 and ``prompt_seen`` [P, V] bool."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self._entries: dict[int, _Entry] = {}
        """id(request) -> its row (an entry is dropped with its request)."""
        self._free: list[int] = []

    @staticmethod
    def keeps(row: object) -> bool:
        """Whether a row is a live request with a history here (else: count its lists)."""
        return hasattr(row, "request_id")

    def gather(
        self, requests: Sequence, vocab: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts [S, V], prompt_seen [S, V]) of these requests' outputs on the host,
        after adding what arrived since the last step."""
        self._reset_if(vocab, like)
        rows, new_rows, new_tokens = [], [], []
        for req in requests:
            entry = self._entries.get(id(req))
            if entry is None or entry.owner() is not req:
                entry = self._add(req, vocab, like)
            outputs = req.output_token_ids
            if len(outputs) < entry.counted:  # outputs were cut (a stop string): recount
                self._fill(entry.row, req, vocab)
                entry.counted = len(outputs)
            elif len(outputs) > entry.counted:
                fresh = outputs[entry.counted :]
                new_rows.extend([entry.row] * len(fresh))
                new_tokens.extend(fresh)
                entry.counted = len(outputs)
            rows.append(entry.row)
        assert self.counts is not None and self.prompt_seen is not None
        if new_tokens:
            where = (_long(new_rows, like), _long(new_tokens, like))
            ones = torch.ones(len(new_tokens), dtype=self.counts.dtype, device=like.device)
            self.counts.index_put_(where, ones, accumulate=True)
        index = _long(rows, like)
        return self.counts[index], self.prompt_seen[index]

    def _reset_if(self, vocab: int, like: torch.Tensor) -> None:
        counts = self.counts
        if counts is None or counts.shape[1] != vocab or counts.device != like.device:
            self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=like.device)
            self.prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=like.device)
            self._entries.clear()
            self._free.clear()

    def _add(self, req, vocab: int, like: torch.Tensor) -> _Entry:
        row = self._take_row(like)
        entry = _Entry(row, len(req.output_token_ids), weakref.ref(req))
        self._entries[id(req)] = entry
        weakref.finalize(req, self._release, id(req), row)
        self._fill(row, req, vocab)
        return entry

    def _fill(self, row: int, req, vocab: int) -> None:
        """Row ``row`` := the request's outputs' counts and its prompt's tokens."""
        assert self.counts is not None and self.prompt_seen is not None
        counts, seen = self.counts[row], self.prompt_seen[row]
        counts.zero_()
        seen.zero_()
        outputs = _long(list(req.output_token_ids), counts)
        counts.index_put_((outputs,), torch.ones_like(outputs, dtype=counts.dtype), True)
        seen[_long(list(req.prompt_token_ids), seen)] = True

    def _take_row(self, like: torch.Tensor) -> int:
        if not self._free:
            self._sweep()
        if self._free:
            return self._free.pop()
        assert self.counts is not None and self.prompt_seen is not None
        old = self.counts.shape[0]
        grow = max(8, old)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.counts.shape[1])])
        self.prompt_seen = torch.cat(
            [self.prompt_seen, self.prompt_seen.new_zeros(grow, self.prompt_seen.shape[1])]
        )
        self._free.extend(range(old + grow - 1, old, -1))
        return old

    def _sweep(self) -> None:
        """Give back the rows of requests that have finished (still referenced elsewhere)."""
        for key, entry in list(self._entries.items()):
            req = entry.owner()
            if req is None or getattr(req, "is_finished", False):
                self._release(key, entry.row)

    def _release(self, key: int, row: int) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.row == row:
            del self._entries[key]
            self._free.append(row)

    @property
    def num_rows_in_use(self) -> int:
        return len(self._entries)


def _long(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return upload(values, torch.int64, like.device)
