"""The speech scheduler: batches Whisper decoder steps across many windows (requests).

It runs beside the text engine, in its own thread that alone touches the model. Each
admitted window gets a cache row: its encoder output's cross-attention K/V (computed once
at admission) and its own self-attention K/V. A window is prefilled alone (prompts differ
in length); then every live row advances one token per batched step. Finished rows hand
their result to the window's callback and the last live row moves into the freed slot.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenmill.speech.loader import LoadedWhisper
from tokenmill.speech.rules import force_timestamps_, timestamp_bans
from tokenmill.speech.whisper import DecoderCache
from tokenmill.threads import release_openmp_threads

logger = logging.getLogger(__name__)


class Cancelled(Exception):
    """The window's request went away (client disconnect, ``cancel()``)."""


@dataclass(frozen=True)
class WindowResult:
    tokens: list[int]
    """Generated tokens, eot excluded."""
    sum_logprob: float
    finished: bool
    no_speech_prob: float = 0.0
    """Probability of the no-speech token right after the prompt's sot token."""
    """True when the row emitted eot (False: it hit its token limit)."""
    error: BaseException | None = None


@dataclass
class WindowRequest:
    """One 30 s window to decode."""

    mel: torch.Tensor
    """[n_mels, 3000] features."""
    prompt: list[int]
    """Decoder input: optional <|startofprev|> + previous text, then the sot sequence."""
    on_done: Callable[[WindowResult], None]
    timestamps: bool = True
    temperature: float = 0.0
    max_new_tokens: int = 224
    only: tuple[int, ...] | None = None
    """When set, the only tokens allowed (language detection: the language tokens)."""
    generator: torch.Generator | None = None
    cancelled: threading.Event | None = None
    """Set it to drop the window at the next step (its result then carries an error)."""


@dataclass
class _Row:
    req: WindowRequest
    length: int
    """Tokens in the row's self-attention cache."""
    generated: list[int] = field(default_factory=list)
    sum_logprob: float = 0.0
    no_speech_prob: float = 0.0


class SpeechEngine:
    """Owns the model and a ``DecoderCache`` of ``max_rows`` rows; ``submit`` is thread-safe."""

    def __init__(self, loaded: LoadedWhisper, max_rows: int = 16) -> None:
        self.loaded = loaded
        self.cfg = loaded.model.cfg
        dtype = next(loaded.model.parameters()).dtype
        self.cache = DecoderCache(self.cfg, max_rows, dtype)
        self.max_rows = max_rows
        self.rows: list[_Row] = []
        self.inbox: queue.SimpleQueue[WindowRequest | None] = queue.SimpleQueue()
        self.pending: list[WindowRequest] = []
        vocab = self.cfg.vocab_size
        self.suppress = torch.zeros(vocab, dtype=torch.bool)
        self.suppress[list(loaded.suppress)] = True
        self.suppress[loaded.tokens.no_timestamps] = True
        self.suppress_begin = torch.zeros(vocab, dtype=torch.bool)
        self.suppress_begin[list(loaded.suppress_begin)] = True
        self.steps = 0
        release_openmp_threads()  # this thread loaded the model; the engine thread computes
        self._thread = threading.Thread(target=self._loop, name="tokenmill-speech", daemon=True)
        self._thread.start()

    def submit(self, req: WindowRequest) -> None:
        if len(req.prompt) + req.max_new_tokens > self.cfg.max_target_positions:
            raise ValueError(
                f"prompt ({len(req.prompt)}) + max_new_tokens ({req.max_new_tokens}) exceeds "
                f"the decoder's {self.cfg.max_target_positions} positions"
            )
        self.inbox.put(req)

    def close(self) -> None:
        self.inbox.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            block = not self.rows and not self.pending
            try:
                while True:
                    item = self.inbox.get(block=block)
                    block = False
                    if item is None:
                        return self._fail_all(RuntimeError("the speech engine was closed"))
                    self.pending.append(item)
            except queue.Empty:
                pass
            try:
                with torch.inference_mode():
                    self._admit()
                    if self.rows:
                        self._step()
            except Exception as e:  # a bug must fail its requests, not hang them
                logger.exception("speech step failed")
                self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        for r in self.rows:
            r.req.on_done(WindowResult([], 0.0, False, error=error))
        for req in self.pending:
            req.on_done(WindowResult([], 0.0, False, error=error))
        self.rows, self.pending = [], []

    def _admit(self) -> None:
        """Encode the waiting windows that fit in one batch, store their cross K/V, prefill."""
        free = self.max_rows - len(self.rows)
        batch, self.pending = self.pending[:free], self.pending[free:]
        if not batch:
            return
        model = self.loaded.model
        dtype = self.cache.self_k.dtype
        enc = model.encoder(torch.stack([r.mel for r in batch]).to(dtype))
        first = len(self.rows)
        model.decoder.set_cross(enc, self.cache, slice(first, first + len(batch)))
        for req in batch:
            i = len(self.rows)
            row = _Row(req, len(req.prompt))
            self.rows.append(row)
            tokens = torch.tensor([req.prompt])
            sot = len(req.prompt) - 1 - req.prompt[::-1].index(self.loaded.tokens.sot)
            at = [sot, len(req.prompt) - 1]
            logits = model.decoder(
                tokens, torch.zeros(1, dtype=torch.long), self.cache, slice(i, i + 1), at=at
            )  # [1, 2, V]: after sot (the no-speech probability), after the prompt
            no_speech = self.loaded.tokens.no_speech
            if no_speech is not None:
                row.no_speech_prob = float(logits[0, 0].float().softmax(-1)[no_speech])
            self._emit([i], logits[:, 1])

    def _step(self) -> None:
        n = len(self.rows)
        last = torch.tensor([[r.generated[-1]] for r in self.rows])
        start = torch.tensor([r.length for r in self.rows])
        logits = self.loaded.model.decoder(last, start, self.cache, slice(0, n))
        for r in self.rows:
            r.length += 1
        self._emit(list(range(n)), logits)
        self.steps += 1

    def _mask(self, rows: list[_Row], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, V] with the banned tokens at -inf, and their log-probabilities.

        Bans are slice fills in place (a few per row), not [B, V] masks built per step.
        """
        tokens = self.loaded.tokens
        ts_begin, inf = tokens.timestamp_begin, float("-inf")
        logits = logits.float()
        only = {
            b: logits[b, list(r.req.only)] for b, r in enumerate(rows) if r.req.only is not None
        }
        logits.masked_fill_(self.suppress, inf)
        ts_rows: list[int] = []
        for b, r in enumerate(rows):
            if b in only:
                logits[b] = inf
                logits[b, list(r.req.only or ())] = only[b]
                continue
            if not r.generated:
                logits[b].masked_fill_(self.suppress_begin, inf)
            if r.req.timestamps:
                ts_rows.append(b)
                for lo, hi in timestamp_bans(r.generated, ts_begin, tokens.eot):
                    logits[b, lo:hi] = inf
            else:
                logits[b, ts_begin:] = inf
        logp = logits.log_softmax(-1)
        force_timestamps_(logits, logp, ts_rows, ts_begin)
        return logits, logp

    def _emit(self, idx: list[int], logits: torch.Tensor) -> None:
        """Pick a token for each of rows ``idx`` from its logits [len(idx), V]; retire finished."""
        rows = [self.rows[i] for i in idx]
        logits, logp = self._mask(rows, logits)
        picks = logits.argmax(-1)
        for b, r in enumerate(rows):
            if r.req.temperature > 0:
                probs = (logits[b] / r.req.temperature).softmax(-1)
                picks[b] = torch.multinomial(probs, 1, generator=r.req.generator)[0]
        chosen = logp.gather(1, picks[:, None])[:, 0]
        # the one device-to-host point of the step
        picked, scores = picks.tolist(), chosen.tolist()
        eot = self.loaded.tokens.eot
        done: list[tuple[int, WindowResult]] = []
        for i, r, tok, score in zip(idx, rows, picked, scores):
            if r.req.cancelled is not None and r.req.cancelled.is_set():
                done.append(
                    (i, WindowResult([], 0.0, False, error=Cancelled("the request was cancelled")))
                )
                continue
            if tok != eot:
                r.generated.append(tok)
                r.sum_logprob += score
            full = len(r.generated) >= r.req.max_new_tokens
            if tok == eot or full:
                r.sum_logprob += score if tok == eot else 0.0
                done.append(
                    (
                        i,
                        WindowResult(
                            list(r.generated), r.sum_logprob, tok == eot, r.no_speech_prob
                        ),
                    )
                )
        for i, result in sorted(done, key=lambda d: -d[0]):
            self._retire(i).req.on_done(result)

    def _retire(self, i: int) -> _Row:
        row = self.rows[i]
        last = len(self.rows) - 1
        if i != last:
            self.cache.move(last, i)
            self.rows[i] = self.rows[last]
        self.rows.pop()
        return row
