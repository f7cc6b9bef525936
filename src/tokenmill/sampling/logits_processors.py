"""Logits processors: the per-request edits applied before a token is picked.

Two kinds live here:

* row processors (``LogitsProcessor``) read each row's ``SamplingRow`` and edit the
  whole batch in place: logit bias, allowed tokens, min-tokens suppression,
  penalties, bad words, per-request callables. The
  sampler runs them in order for every row, greedy or random;
* filters for the random rows only, driven by per-row parameter tensors:
  temperature, min-p, top-k / top-p.

Every edit is row-local (row i's result depends only on row i), which is what
keeps a seeded request reproducible whatever else is in the batch. Parameter
tensors are built from host-side lists (host-to-device only); nothing here reads
a device value back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.sampling.in_flight import InFlightRow

if TYPE_CHECKING:
    from tokenmill.sampling.penalty_history import PenaltyHistories
    from tokenmill.sampling.sampler import SamplingRow

_NEG_INF = float("-inf")


class LogitsProcessor(Protocol):
    """Edits ``logits`` [N, V] float32 in place; ``rows[i]`` describes row i.

    Must be row-local and must not synchronize with the device (no ``.item()``).
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None: ...


# ---- row processors -------------------------------------------------------------
# Each takes ``only``: the indices of the rows it must look at (the sampler's plan knows
# them, ``batch.py``); None: every row, each checked here.


def _rows(rows: Sequence[SamplingRow], only: Sequence[int] | None) -> Sequence[int]:
    return range(len(rows)) if only is None else only


def apply_logit_bias(
    logits: torch.Tensor, rows: Sequence[SamplingRow], only: Sequence[int] | None = None
) -> None:
    """logits[i, t] += params.logit_bias[t] (ids were checked by ``verify_for_vocab``)."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    values: list[float] = []
    for i in _rows(rows, only):
        for token, bias in (rows[i].params.logit_bias or {}).items():
            row_idx.append(i)
            tok_idx.append(token)
            values.append(bias)
    if not row_idx:
        return
    index = (_long(row_idx, logits), _long(tok_idx, logits))
    logits.index_put_(index, _float(values, logits), accumulate=True)


def apply_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], only: Sequence[int] | None = None
) -> None:
    """Forbid EOS and stop_token_ids while fewer than min_tokens tokens were generated.

    Only the count matters, not the tokens: tokens still in flight (asynchronous
    scheduling) count too, so min_tokens needs no synchronous steps."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i in _rows(rows, only):
        row = rows[i]
        if len(row.output_token_ids) + row.num_placeholders - 1 >= row.params.min_tokens:
            continue
        banned = row.eos_token_ids.union(row.params.stop_token_ids or ())
        row_idx.extend([i] * len(banned))
        tok_idx.extend(banned)
    if row_idx:
        logits[_long(row_idx, logits), _long(tok_idx, logits)] = _NEG_INF


def apply_penalties(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    only: Sequence[int] | None = None,
    histories: PenaltyHistories | None = None,
) -> None:
    """Repetition (HF), then frequency and presence (OpenAI) penalties.

    repetition: for tokens seen in prompt or output, l > 0 -> l / r, l <= 0 -> l * r.
    frequency/presence: l -= frequency * count_in_output + presence * (count > 0).
    Only the rows that use a penalty are touched. With ``histories`` the counts of live
    requests come from their device-resident rows (``penalty_history.py``), not from
    their token lists.
    """
    selected = (
        list(only) if only is not None
        else [i for i, row in enumerate(rows) if row.params.uses_penalties]
    )  # fmt: skip
    if not selected:
        return
    sel_rows = [rows[i] for i in selected]
    index = _long(selected, logits)
    sub = logits[index]  # [S, V]
    vocab = logits.shape[1]
    out_counts, prompt_seen = _penalty_state(sel_rows, vocab, sub, histories)  # [S, V] each
    _count_in_flight(out_counts, sel_rows)
    rep = [r.params.repetition_penalty for r in sel_rows]
    if any(p != 1.0 for p in rep):
        seen = prompt_seen | (out_counts > 0)
        penalty = torch.where(seen, _float(rep, sub)[:, None], 1.0)  # [S, V]
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    freq = _float([r.params.frequency_penalty for r in sel_rows], sub)
    pres = _float([r.params.presence_penalty for r in sel_rows], sub)
    sub -= freq[:, None] * out_counts + pres[:, None] * (out_counts > 0)
    logits[index] = sub


def _penalty_state(
    sel_rows: Sequence[SamplingRow],
    vocab: int,
    like: torch.Tensor,
    histories: PenaltyHistories | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output-token counts [S, V] in ``like``'s dtype, prompt token set [S, V] bool): from
    the histories for live requests, from the token lists for the other rows."""
    bases = [getattr(r, "request", r) for r in sel_rows]  # an InFlightRow's request
    kept = [] if histories is None else [i for i, b in enumerate(bases) if histories.keeps(b)]
    if len(kept) == len(sel_rows):
        assert histories is not None
        counts, seen = histories.gather(bases, vocab, like)
        return counts.to(like.dtype), seen
    counts = _token_counts([r.output_token_ids for r in sel_rows], vocab, like)
    seen = _token_mask([r.prompt_token_ids for r in sel_rows], vocab, like)
    if kept:
        assert histories is not None
        kept_counts, kept_seen = histories.gather([bases[i] for i in kept], vocab, like)
        index = _long(kept, like)
        counts[index] = kept_counts.to(like.dtype)
        seen[index] = kept_seen
    return counts, seen


def apply_allowed_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], only: Sequence[int] | None = None
) -> None:
    """Rows with ``params.allowed_token_ids``: every other logit becomes -inf."""
    for i in _rows(rows, only):
        allowed = rows[i].params.allowed_token_ids
        if allowed:
            keep = logits[i, _long(allowed, logits)]
            logits[i] = _NEG_INF
            logits[i, _long(allowed, logits)] = keep


def apply_bad_words(
    logits: torch.Tensor, rows: Sequence[SamplingRow], only: Sequence[int] | None = None
) -> None:
    """vLLM's bad words: for each variant ``w`` of ``params.bad_words_token_ids``, ban
    ``w[-1]`` when the row's last ``len(w) - 1`` output tokens are ``w[:-1]``.

    A one-token word needs no history, so it runs with tokens in flight; longer words
    make the request's steps synchronous (``SamplingParams.reads_output_tokens``), so
    ``output_token_ids`` is then complete (no ``InFlightRow``; a draft row has the drafts
    before it appended)."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i in _rows(rows, only):
        row = rows[i]
        words = row.params.bad_words_token_ids
        if not words:
            continue
        past = row.output_token_ids
        for word in words:
            k = len(word) - 1
            if k == 0:
                row_idx.append(i)
                tok_idx.append(word[0])
                continue
            assert not isinstance(row, InFlightRow), "a long bad word steps synchronously"
            if len(past) >= k and list(past[len(past) - k :]) == word[:k]:
                row_idx.append(i)
                tok_idx.append(word[k])
    if row_idx:
        logits[_long(row_idx, logits), _long(tok_idx, logits)] = _NEG_INF


def apply_request_processors(
    logits: torch.Tensor, rows: Sequence[SamplingRow], only: Sequence[int] | None = None
) -> None:
    """Each row's own ``params.logits_processors`` (vLLM's per-request callables):
    ``f(output_ids, row_logits)`` or ``f(prompt_ids, output_ids, row_logits)`` -> logits."""
    for i in _rows(rows, only):
        row = rows[i]
        for f in row.params.logits_processors or ():
            out_ids = list(row.output_token_ids)
            if _arity(f) >= 3:
                result = f(list(row.prompt_token_ids), out_ids, logits[i])
            else:
                result = f(out_ids, logits[i])
            if result is not None and result is not logits[i]:
                logits[i] = result


def _arity(f) -> int:
    import inspect

    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


class RowProcessor:
    """A row processor that touches only some rows: ``needs(row)`` says which (asked once
    per batch composition by the sampler's plan, ``batch.py``, so it may depend only on
    a row's fixed state: its parameters, its grammar), and ``apply(logits, rows, only)``
    edits those rows (``only``: their indices). Called as a plain ``LogitsProcessor`` it
    asks every row itself."""

    __slots__ = ("apply", "needs")

    def __init__(
        self,
        apply: Callable[[torch.Tensor, Sequence[SamplingRow], Sequence[int]], None],
        needs: Callable[[SamplingRow], bool],
    ) -> None:
        self.apply = apply
        self.needs = needs

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        only = [i for i, row in enumerate(rows) if self.needs(row)]
        if only:
            self.apply(logits, rows, only)


def default_processors(histories: PenaltyHistories | None = None) -> tuple[RowProcessor, ...]:
    """The built-in row processors, in vLLM's order of application (per-request callables
    last, as vLLM v0 ran them after its own); penalties read ``histories`` when given."""
    penalties = apply_penalties if histories is None else partial(apply_penalties,
                                                                 histories=histories)  # fmt: skip
    return (
        RowProcessor(apply_logit_bias, lambda row: bool(row.params.logit_bias)),
        RowProcessor(apply_allowed_tokens, lambda row: bool(row.params.allowed_token_ids)),
        RowProcessor(apply_min_tokens, lambda row: row.params.min_tokens > 0),
        RowProcessor(penalties, lambda row: row.params.uses_penalties),
        RowProcessor(apply_bad_words, lambda row: bool(row.params.bad_words_token_ids)),
        RowProcessor(apply_request_processors, lambda row: bool(row.params.logits_processors)),
    )


DEFAULT_PROCESSORS: tuple[RowProcessor, ...] = default_processors()
"""The built-in row processors, without penalty histories (every row's counts from its
lists): a ``Sampler`` makes its own, with histories."""


# ---- filters for random rows -----------------------------------------------------


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> None:
    """logits [S, V] /= temperature [S] (all > 0: greedy rows never get here)."""
    logits.div_(temperature[:, None])


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below min_p [S] times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [S, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [S, 1]
    logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Sort-based top-k and top-p masking (as vLLM); returns the masked logits [S, V].

    top_k [S] int64 in [1, V] (V = disabled); tokens tied with the k-th are kept.
    top_p [S] float in (0, 1]; the most likely token always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending, [S, V]
    vocab = logits.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k)[:, None])  # [S, 1] k-th largest
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)  # [S, V]
        drop = cum <= 1 - top_p[:, None]
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return sorted_logits.scatter(dim=-1, index=order, src=sorted_logits)


# ---- helpers ---------------------------------------------------------------------


def upload(
    values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without waiting for the device: on CUDA
    through pinned memory and a non-blocking copy (a pageable copy synchronizes the
    stream, which would stall the step queued behind it with asynchronous scheduling)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def _long(values: Sequence[int] | Sequence[Sequence[int]], like: torch.Tensor) -> torch.Tensor:
    return upload(values, torch.int64, like.device)


def _float(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return upload(values, like.dtype, like.device)


def _padded_ids(
    token_lists: Sequence[Sequence[int]], vocab: int, like: torch.Tensor
) -> torch.Tensor:
    """[S, W] int64 ids, padded with ``vocab`` (a spare column dropped afterwards)."""
    width = max(1, max(len(t) for t in token_lists))
    padded = [list(t) + [vocab] * (width - len(t)) for t in token_lists]
    return _long(padded, like)


def _token_counts(
    token_lists: Sequence[Sequence[int]], vocab: int, like: torch.Tensor
) -> torch.Tensor:
    """[S, V] occurrences of each token id in each row's list, in ``like``'s dtype."""
    ids = _padded_ids(token_lists, vocab, like)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=like.dtype, device=like.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=like.dtype))
    return counts[:, :vocab]


def _count_in_flight(counts: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """counts [S, V] += each row's output token still in flight (``InFlightRow``: on the
    device, read there; no host sync)."""
    found = [(i, row) for i, row in enumerate(rows) if isinstance(row, InFlightRow)]
    if not found:
        return
    source = found[0][1].source
    assert all(row.source is source for _, row in found), "one previous step's ids"
    ids = source[_long([row.index for _, row in found], counts)]
    counts.index_put_((_long([i for i, _ in found], counts), ids),
                      torch.ones(len(found), dtype=counts.dtype, device=counts.device),
                      accumulate=True)  # fmt: skip


def _token_mask(
    token_lists: Sequence[Sequence[int]], vocab: int, like: torch.Tensor
) -> torch.Tensor:
    """[S, V] bool: token id occurs in the row's list."""
    ids = _padded_ids(token_lists, vocab, like)
    mask = torch.zeros(len(token_lists), vocab + 1, dtype=torch.bool, device=like.device)
    mask.scatter_(1, ids, True)
    return mask[:, :vocab]
