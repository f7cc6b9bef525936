"""Our model driven step by step over a paged KV cache with deliberately scattered block ids,
built from a Hugging Face model (importable as ``paged_runner`` from every test folder)."""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel

from tokenmill.attention import AttentionMetadata, ForwardContext
from tokenmill.attention.backends import REFERENCE, AttentionBackend
from tokenmill.layers.ops import Ops
from tokenmill.models import resolve_model_class
from tokenmill.models.base import CausalLM

BLOCK_SIZE = 4


def build_ours(hf_model: PreTrainedModel, ops: Ops | None = None) -> CausalLM:
    """Our model for ``hf_model``, built from its config dict and loaded from its state dict;
    ``ops``: the layers' kernels and attention backend (None: selected for the CPU)."""
    config = hf_model.config.to_dict()
    model = resolve_model_class([type(hf_model).__name__])(config, torch.float32, ops=ops)
    model.load_weights(hf_model.state_dict().items())
    return model.eval()


class PagedRunner:
    """Flattened forward steps of several sequences; ``backend``: the attention backend
    (None: the reference)."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int = 96,
        seed: int = 0,
        backend: AttentionBackend | None = None,
    ) -> None:
        self.model = model
        self.backend = backend or REFERENCE
        shape = (2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(model.num_layers)]
        self.free = list(range(1, num_blocks))  # block 0 stays unused: padding in block tables
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """One flattened forward: each (seq, new token ids) -> its logits [len(ids), vocab]."""
        query_lens, seq_lens, tables, ids, positions = [], [], [], [], []
        for seq, new in chunks:
            start = self.lens.get(seq, 0)
            end = start + len(new)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            self.lens[seq] = end
            query_lens.append(len(new))
            seq_lens.append(end)
            tables.append(list(table))
            ids += new
            positions += range(start, end)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
        logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))

    def last(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """``step``, keeping each sequence's logits of its last new token [vocab]."""
        return [logits[-1] for logits in self.step(chunks)]

    def greedy(self, seq: str, prompt: list[int], steps: int) -> list[int]:
        """Prefill ``prompt`` then decode token by token; returns the ``steps`` new tokens."""
        out = [int(self.step([(seq, prompt)])[0][-1].argmax())]
        while len(out) < steps:
            out.append(int(self.step([(seq, [out[-1]])])[0][-1].argmax()))
        return out
