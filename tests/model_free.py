"""A model-free executor: the engine's scheduler, KV manager and step pipeline driven
without a model (importable as ``model_free`` from every test folder).

Its "model" is a fixed function: the token after position p of a request is
``reference(prompt)[p - len(prompt)]``, so every request has one known greedy output, and
the executor checks that each step's known input tokens are exactly that sequence.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from tokenmill.executor import Executor
from tokenmill.scheduler import SchedulerOutput
from tokenmill.worker.model_runner import ModelRunnerOutput, verify_drafts

EOS = 0


def reference(prompt: tuple[int, ...], length: int, eos_every: int = 0) -> list[int]:
    """The model's greedy continuation of ``prompt``: tokens in 3..52, and EOS at a
    prompt-dependent place when ``eos_every`` is set."""
    seed = zlib.crc32(bytes(str(prompt), "ascii"))
    out = [3 + (seed // (i + 1) + 7 * i) % 50 for i in range(length)]
    if eos_every:
        cut = seed % eos_every
        if cut < length:
            out[cut] = EOS
    return out


@dataclass(frozen=True)
class _Handle:
    output: ModelRunnerOutput


class ModelFreeExecutor(Executor):
    """Answers every step from ``reference``; ``steps`` counts launches."""

    def __init__(self, max_len: int, block_size: int, eos_every: int = 0) -> None:
        self.max_len = max_len
        self.block_size = block_size
        self.eos_every = eos_every
        self.steps = 0

    def sequence(self, prompt) -> list[int]:
        prompt = tuple(prompt)
        return [*prompt, *reference(prompt, self.max_len, self.eos_every)]

    def launch(self, sched: SchedulerOutput) -> _Handle:
        self.steps += 1
        tokens = []
        for s in sched.seqs:
            req, drafts = s.request, s.draft_token_ids
            seq = self.sequence(req.prompt_token_ids)
            base_end = s.end - len(drafts)
            known = req.all_token_ids[s.start : base_end]
            assert known == seq[s.start : s.start + len(known)], "wrong input tokens"
            assert base_end - s.start - len(known) <= 1, "more than one placeholder"
            assert len(s.block_table) * self.block_size >= s.end, "too few blocks for the step"
            if not s.samples:
                tokens.append([])
                continue
            # Row j predicts position base_end + j given the drafts before it.
            sampled = [seq[base_end + j] for j in range(len(drafts) + 1)]
            tokens.append(verify_drafts(drafts, sampled) if drafts else sampled)
        return _Handle(ModelRunnerOutput(tokens, None, {}))

    def collect(self, handle: _Handle) -> ModelRunnerOutput:
        return handle.output
