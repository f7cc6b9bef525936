"""Turns engine progress into RequestOutputs: text, stop strings, logprobs, n > 1."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.engine.stop_strings import StopStringMatcher
from tokenmill.metrics.stats import RequestFinished
from tokenmill.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import RequestOutputKind
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenmill.worker import TokenLogprobs


@dataclass
class ParentState:
    """A user request; n > 1 fans out into n child requests that share it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    completions: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_unfinished: int = 0
    error: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens the first child found in the prefix cache."""
    arrival: float = field(default_factory=time.monotonic)
    started: bool = False
    """Some child was scheduled (queue time is measured up to then)."""
    timed_out: bool = False
    """Aborted for waiting past queue_timeout."""
    reasons: list[str] = field(default_factory=list)
    """Finish reason of each child that ended, in order."""

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


@dataclass
class ChildState:
    parent: ParentState
    index: int
    detok: IncrementalDetokenizer | None
    """None with ``detokenize=False``: token ids only, the text stays empty."""
    stops: StopStringMatcher
    deferred: bool = False
    """Text decoded once when the child finishes, not token by token: nobody sees partial
    text (final-only output, no stop strings), and the one-shot decode gives the same text
    (see ``IncrementalDetokenizer``) for a fraction of the cost."""
    hidden_last: bool = False
    """Deferred: the last token stopped the request and its text is left out."""
    text_sent: int = 0
    tokens_sent: int = 0
    logprobs_sent: int = 0
    completion: CompletionOutput = field(init=False)

    def __post_init__(self) -> None:
        self.completion = self.parent.completions[self.index]


class OutputProcessor:
    """Owns the user-request view: each parent (what the caller submitted) and its n
    child sequences; the rest of the engine sees only sequences."""

    def __init__(
        self, tokenizer: Tokenizer, on_finished: Callable[[RequestFinished], None] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.on_finished = on_finished
        """Called with the event record of every user request that ended."""
        self.children: dict[str, ChildState] = {}
        self._child_ids: dict[str, list[str]] = {}
        """Live parent id -> its children's ids (all of them until the last finishes)."""

    def has_parent(self, request_id: str) -> bool:
        return request_id in self._child_ids

    def live_parent_ids(self) -> list[str]:
        return list(self._child_ids)

    def parent(self, request_id: str) -> ParentState | None:
        """The live user request a sequence (or the user request id itself) belongs to."""
        child = self.children.get(request_id)
        if child is not None:
            return child.parent
        ids = self._child_ids.get(request_id)
        return self.children[ids[0]].parent if ids and ids[0] in self.children else None

    def child_ids(self, request_id: str) -> list[str]:
        """The sequences of a live user request ([] when unknown or finished)."""
        return self._child_ids.get(request_id, [])

    def add(self, parent: ParentState, requests: list[Request]) -> None:
        child_ids = [r.request_id for r in requests]
        self._child_ids[parent.request_id] = child_ids
        for index, (cid, req) in enumerate(zip(child_ids, requests)):
            params = req.params
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, params.skip_special_tokens
                )
            stops = StopStringMatcher(list(params.stop or []), params.include_stop_str_in_output)
            deferred = parent.kind is RequestOutputKind.FINAL_ONLY and not params.stop
            self.children[cid] = ChildState(parent, index, detok, stops, deferred)
        parent.num_unfinished = len(child_ids)

    def record_prompt_logprobs(
        self, request_id: str, start: int, entries: list[TokenLogprobs]
    ) -> None:
        child = self.children.get(request_id)
        if child is None:  # ended (aborted) while its step was in flight
            return
        parent = child.parent
        if parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]
        for j, entry in enumerate(entries):
            if start + 1 + j == len(
                parent.prompt_logprobs
            ):  # skip positions seen before a preemption
                parent.prompt_logprobs.append(self._position(entry))

    def process_tokens(
        self, req: Request, num_new: int, logprobs: list[TokenLogprobs] | None
    ) -> tuple[str | None, int]:
        """Detokenize the request's newest ``num_new`` tokens one by one, as a plain decode
        would have. Returns (the stop string one of them completed, how many tokens up to
        and including that one) or (None, num_new); the caller cuts the rest."""
        child = self.children[req.request_id]
        if child.index == 0:
            child.parent.num_cached_tokens = req.num_cached_tokens
        outputs = req.output_token_ids
        completion = child.completion
        completion.token_ids = outputs
        status = req.status
        hidden_stop = status is RequestStatus.FINISHED_STOPPED and not (
            req.params.include_stop_str_in_output
        )  # the last token stopped the request (EOS, a stop id) and is not shown
        if child.deferred or child.detok is None:  # text decoded once, at the end
            for entry in logprobs or ():
                self._add_logprobs(completion, entry)
            child.hidden_last = hidden_stop
            return None, num_new
        first = len(outputs) - num_new
        for j in range(num_new):
            if logprobs:
                self._add_logprobs(completion, logprobs[j])
            hidden = hidden_stop and j == num_new - 1
            delta = "" if hidden else child.detok.append([outputs[first + j]])
            text, stop = child.stops.feed(delta)
            completion.text += text
            if stop is not None:
                completion.stop_reason = stop
                return stop, j + 1
        return None, num_new

    def finish(self, req: Request, error: str | None = None) -> RequestOutput | None:
        """Mark a child finished (after the scheduler freed it); emit its output."""
        child = self.children.pop(req.request_id, None)
        if child is None:
            return None
        comp = child.completion
        if child.detok is not None:
            _finish_text(child, req)
        if comp.stop_reason is None:
            comp.stop_reason = req.stop_reason  # a stop token id, or None
        comp.token_ids = list(req.output_token_ids)
        comp.finish_reason = req.status.value
        parent = child.parent
        parent.num_unfinished -= 1
        parent.reasons.append(req.status.value)
        if parent.finished:
            del self._child_ids[parent.request_id]
            if self.on_finished is not None:
                self.on_finished(
                    RequestFinished(tuple(parent.reasons), parent.arrival, parent.timed_out)
                )
        if error is not None:
            child.parent.error = error
        return self._emit(child)

    def progress(self, req: Request) -> RequestOutput | None:
        return self._emit(self.children[req.request_id])

    # -- building outputs -------------------------------------------------------
    def _emit(self, child: ChildState) -> RequestOutput | None:
        parent = child.parent
        if parent.kind is RequestOutputKind.FINAL_ONLY:
            return self._output(parent, parent.completions) if parent.finished else None
        if parent.kind is RequestOutputKind.DELTA:
            return self._output(parent, [self._delta(child)])
        return self._output(parent, [_copy(c) for c in parent.completions])

    def _output(self, parent: ParentState, comps: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=comps,
            finished=parent.finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            error=parent.error,
        )

    def _delta(self, child: ChildState) -> CompletionOutput:
        comp = child.completion
        delta = CompletionOutput(
            index=comp.index,
            text=comp.text[child.text_sent :],
            token_ids=comp.token_ids[child.tokens_sent :],
            cumulative_logprob=comp.cumulative_logprob,
            logprobs=comp.logprobs[child.logprobs_sent :] if comp.logprobs is not None else None,
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
        )
        child.text_sent = len(comp.text)
        child.tokens_sent = len(comp.token_ids)
        child.logprobs_sent = len(comp.logprobs or [])
        return delta

    def _add_logprobs(self, comp: CompletionOutput, entry: TokenLogprobs) -> None:
        if comp.logprobs is None:
            comp.logprobs = []
        comp.logprobs.append(self._position(entry))
        comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + entry.logprob

    def _position(self, entry: TokenLogprobs) -> PositionLogprobs:
        out: PositionLogprobs = {
            entry.token_id: self._logprob(entry.token_id, entry.logprob, entry.rank)
        }
        for rank, (tid, value) in enumerate(entry.top, start=1):
            if tid not in out:
                out[tid] = self._logprob(tid, value, rank)
        return out

    def _logprob(self, token_id: int, value: float, rank: int) -> Logprob:
        tok = self.tokenizer
        if token_id >= tok.vocab_size:  # a model row past the tokenizer's (padded vocab)
            return Logprob(logprob=value, rank=rank, decoded_token="", bytes=b"")
        return Logprob(
            logprob=value,
            rank=rank,
            decoded_token=tok.decode([token_id], skip_special_tokens=False),
            bytes=tok.token_bytes(token_id),
        )


def _finish_text(child: ChildState, req: Request) -> None:
    """The text's last part: all of it when deferred, else what the detokenizer and the
    stop-string matcher still hold back (nothing after a matched stop string)."""
    comp, detok = child.completion, child.detok
    assert detok is not None, "only detokenized children have text to finish"
    if child.deferred:
        shown = req.output_token_ids[: len(req.output_token_ids) - child.hidden_last]
        comp.text = detok.append(shown) + detok.flush()
    if not isinstance(comp.stop_reason, str):
        comp.text += child.stops.feed(detok.flush())[0] + child.stops.flush()


def _copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        index=c.index,
        text=c.text,
        token_ids=list(c.token_ids),
        cumulative_logprob=c.cumulative_logprob,
        logprobs=list(c.logprobs) if c.logprobs is not None else None,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )
