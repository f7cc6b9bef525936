"""The output head and argmax in one native call, for steps where every row is greedy.

A batched decode step on CPU spends a sixth of its time in the output head (SmolLM2: 32
rows x 49k tokens x 576 inputs, 9.7 of 55 ms), computed exactly (float32-accurate
activations: two bfloat16 terms, or float32 FMAs on widened weights) only for an argmax
to read one token of each row. ``dense16_greedy`` (``kernels/dense16_gemm.c``) computes
the logits with one bfloat16 activation term instead (twice the rate), bounds that
approximation's error per row, and runs the exact kernel only on the tiles of the tokens
that could be the maximum (one in the batches measured). The token is the full head's
bit for bit, ties to the first index as ``argmax``; a row that the bound can not decide
(a non-finite input or logit) is computed in full.

Taken for a step when the model's logits are one bfloat16 head's output as they are (no
soft cap or scaling), the CPU has AVX512-BF16, the step has ``MIN_ROWS`` rows or more and
the sampler would only take the argmax (``Sampler.argmax_only``); ``$TOKENMILL_GREEDY_HEAD``
turns it off.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import nn

from tokenmill import native
from tokenmill.env import TOKENMILL_GREEDY_HEAD
from tokenmill.host_memory import oversized
from tokenmill.native import dense16
from tokenmill.quant.dense16 import Dense16Method
from tokenmill.sampling.argmax import argmax_rows

logger = logging.getLogger(__name__)

MIN_ROWS = 2
"""Below this the head reads its weights once for one row, bound by memory, not
arithmetic: the one-term pass saves nothing (1.7 ms either way for 49k x 576 here)."""

EXACT_KERNELS = ("bf16-fma", "bf16-avx512bf16")
"""The exact bfloat16 kernels whose tiles ``dense16_greedy`` recomputes bit for bit (AMX
tiles accumulate differently; a one-term head is already the fast one)."""


class GreedyHead:
    """``__call__(hidden)`` = ``argmax_rows(compute_logits(hidden))`` for a head ``layer``
    whose ``method.apply`` is the model's ``compute_logits``."""

    def __init__(self, layer: nn.Module, method: Dense16Method) -> None:
        self.layer = layer
        self.method = method
        self.tiles = layer.get_buffer("wtiles")
        self.vocab = cast(int, layer.dense16_out)
        self.wnorm = dense16.max_row_norm(self.tiles, self.vocab)
        """The largest norm of a head row: the error bound's weight factor."""
        self._approx = torch.empty(0)
        """The one-term logits' scratch ([rows x vocab] float32), kept across steps
        (``host_memory.oversized``: replaced when far too big)."""

    @classmethod
    def of(cls, model: nn.Module, device: torch.device) -> GreedyHead | None:
        """The model's greedy head, or None where it does not apply (see the module doc)."""
        if device.type != "cpu" or not TOKENMILL_GREEDY_HEAD.get() or not native.available():
            return None
        find = getattr(model, "logits_layer", None)
        layer = find() if find is not None else None
        method = getattr(layer, "method", None)
        if layer is None or not isinstance(method, Dense16Method):
            return None
        if method.kernel not in EXACT_KERNELS or not dense16.has_avx512_bf16():
            return None
        logger.info(
            "greedy head: all-greedy steps of %d+ rows take one-term logits, then %s on the "
            "candidates ($TOKENMILL_GREEDY_HEAD=0: off)",
            MIN_ROWS,
            method.kernel,
        )
        return cls(layer, method)

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether ``hidden`` [M, hidden] is a step this head serves: float32 (the head's
        output is then float32 as it is) and at least ``MIN_ROWS`` rows."""
        return hidden.dtype == torch.float32 and hidden.dim() == 2 and len(hidden) >= MIN_ROWS

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] float32 (``takes``) -> [M] int64 token ids."""
        x = hidden.contiguous()
        need = x.shape[0] * self.vocab
        if self._approx.numel() < need or oversized(self._approx, need):
            self._approx = torch.empty(need)
        ids = dense16.greedy(
            x, self.tiles, self.method.kernel_id, self.vocab, self.wnorm, self._approx
        )
        undecided = (ids < 0).nonzero().flatten()
        if len(undecided):
            logits = self.method.apply(self.layer, x[undecided], None)
            ids[undecided] = argmax_rows(logits)
        return ids
