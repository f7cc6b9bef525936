"""One tensor-parallel rank's part of a decoder: local sizes, parallel layers, its weights.

Rank r of n holds query heads [r H/n, (r+1) H/n), the KV heads they read (KV/n of them,
or one replicated head when KV < n), MLP columns [r I/n, (r+1) I/n) and vocabulary rows
[r V', (r+1) V') with V' = ceil(V/n) rounded up to 16 (the last shard padded with zero
rows, never looked up, its logits cut off). The model is built from a *local* config with
those sizes (so every layer allocates only its shard), its partial-output layers adopted
by ``layers/parallel.py``, and the checkpoint stream narrowed tensor by tensor
(``weights``): the memory bound stays the shard plus the one tensor in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.distributed.group import RankGroup
from tokenmill.distributed.hybrid_split import HybridSplit, adopt_norms
from tokenmill.distributed.messages import Forward, Logits
from tokenmill.errors import UnsupportedModelError
from tokenmill.layers.linear import Linear, VocabEmbedding
from tokenmill.layers.parallel import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ArchConfig
from tokenmill.quant.gguf_blocks import GgufBlocks

Weight = torch.Tensor | GgufBlocks
VOCAB_ALIGN = 16
"""Vocabulary shards are whole native tiles (16 rows), so a quantized table splits too."""
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TPShard:
    """This process's rank of ``group`` over one architecture (the checkpoint's
    ``ArchConfig``). ``engine/loading.py`` builds and loads through it."""

    cfg: ArchConfig
    group: RankGroup
    split: HybridSplit | None = None
    """How the family's recurrent layers split (``hybrid_split``); None: a decoder."""

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """Replicated KV heads: rank r reads head r // (size / KV)."""
        kv = self.cfg.num_kv_heads
        return self.rank * self.kv_heads if kv >= self.size else self.rank // (self.size // kv)

    @property
    def mlp(self) -> int:
        return self.cfg.intermediate_size // self.size

    @property
    def vocab(self) -> int:
        per_rank = -(-self.cfg.vocab_size // self.size)
        return -(-per_rank // VOCAB_ALIGN) * VOCAB_ALIGN

    def local_hf_config(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's config.json at this rank's sizes (head_dim spelled out, since
        its default hidden / heads would change)."""
        local = {
            **hf_config,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": self.mlp,
            "head_dim": self.cfg.head_dim,
            "vocab_size": self.vocab,
        }
        return local if self.split is None else {**local, **self.split.local(self.size)}

    def adopt(self, model: nn.Module) -> None:
        """Turn the built (not yet loaded) local model's partial layers parallel."""
        group = self.group
        row_parallel = ROW_PARALLEL + (() if self.split is None else self.split.row_parallel)
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, Linear) and leaf in row_parallel:
                RowParallelLinear.adopt(module, group)
            elif isinstance(module, Linear) and leaf == "lm_head":
                VocabParallelHead.adopt(module, group, self.cfg.vocab_size)
            elif isinstance(module, VocabEmbedding):
                VocabParallelEmbedding.adopt(module, group, self.cfg.vocab_size)
        if self.split is not None:
            adopt_norms(model, self.split, group)
        model.vocab_size = self.cfg.vocab_size  # type: ignore[assignment]  # the sampler's

    def stored_types(self, types: Mapping[str, Any]) -> Mapping[str, Any]:
        return types  # the same names: every rank has every layer

    def driver(self, local: CausalLM) -> CausalLM:
        from tokenmill.distributed.driver_model import TensorParallelDriver

        return TensorParallelDriver(local, self.group)

    def handlers(self, model: CausalLM, caches: list) -> dict[type, Callable[[Any], object]]:
        """What a worker does with each broadcast: the same call on its shard."""
        return {
            Forward: lambda m: model(
                m.input_ids,
                m.positions,
                StepContext(m.attn, caches, None, m.state, m.adapter_ids, m.input_embeds),
            ),  # fmt: skip
            Logits: lambda m: model.compute_logits(m.hidden),
        }

    def weights(self, stream: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """The checkpoint stream narrowed to this rank's rows / columns (views where the
        source allows), one tensor at a time."""
        hybrid = {} if self.split is None else self.split.rules
        for name, tensor in stream:
            module, _, kind = name.rpartition(".")  # "model.layers.0.mlp.up_proj", "weight"
            hybrid_rule = hybrid.get(_in_layer(module))
            if hybrid_rule is not None:  # the hybrids load dense tensors only
                yield name, hybrid_rule(self, kind, _dense(tensor))
                continue
            rule = _RULES.get(module.rpartition(".")[2])
            yield name, tensor if rule is None else rule(self, kind, tensor)


def _in_layer(module: str) -> str:
    """ "backbone.layers.3.mixer.in_proj" -> "mixer.in_proj" ("" outside the layers)."""
    _, found, rest = module.partition("layers.")
    return rest.partition(".")[2] if found else ""


# -- per-module rules: (shard, "weight" | "bias", tensor) -> this rank's part ------------


def _q(s: TPShard, kind: str, t: Weight) -> Weight:
    d = s.cfg.head_dim
    return _rows(t, s.rank * s.heads * d, s.heads * d)


def _kv(s: TPShard, kind: str, t: Weight) -> Weight:
    d = s.cfg.head_dim
    return _rows(t, s.first_kv_head * d, s.kv_heads * d)


def _mlp_in(s: TPShard, kind: str, t: Weight) -> Weight:
    return _rows(t, s.rank * s.mlp, s.mlp)


def _row_parallel(width: Callable[[TPShard], int]) -> Callable[[TPShard, str, Weight], Weight]:
    def rule(s: TPShard, kind: str, t: Weight) -> Weight:
        if kind == "bias":  # added once, after the sum: rank 0's
            return t if s.rank == 0 else torch.zeros_like(_dense(t))
        return _cols(t, s.rank * width(s), width(s))

    return rule


def _vocab(s: TPShard, kind: str, t: Weight) -> Weight:
    start = s.rank * s.vocab
    part = _rows(t, min(start, t.shape[0]), max(0, min(s.vocab, t.shape[0] - start)))
    return _pad_rows(part, s.vocab)


_RULES: dict[str, Callable[[TPShard, str, Weight], Weight]] = {
    "q_proj": _q,
    "k_proj": _kv,
    "v_proj": _kv,
    "o_proj": _row_parallel(lambda s: s.heads * s.cfg.head_dim),
    "gate_proj": _mlp_in,
    "up_proj": _mlp_in,
    "down_proj": _row_parallel(lambda s: s.mlp),
    "embed_tokens": _vocab,
    "embeddings": _vocab,  # Mamba2's backbone.embeddings (older checkpoints: .embedding)
    "embedding": _vocab,
    "lm_head": _vocab,
}
"""HF module name -> how its tensors split (norms and everything else: replicated)."""


# -- narrowing dense tensors and raw GGUF blocks -----------------------------------------


def _dense(t: Weight) -> torch.Tensor:
    return t.dequantize() if isinstance(t, GgufBlocks) else t


def _rows(t: Weight, start: int, length: int) -> Weight:
    if isinstance(t, GgufBlocks):
        return t.narrow_rows(start, length)
    return t.narrow(0, start, length)


def _cols(t: Weight, start: int, length: int) -> Weight:
    """Input columns [start, start + length): whole GGUF blocks of the stored type."""
    if not isinstance(t, GgufBlocks):
        return t.narrow(1, start, length)
    block, type_size = GGML_QUANT_SIZES[t.qtype]
    if start % block or length % block:
        raise UnsupportedModelError(
            f"a {t.qtype.name} tensor of shape {t.shape} can not be split into column shards "
            f"of {length} (its blocks hold {block} columns): use a tensor_parallel_size whose "
            "shards are whole blocks, or a float checkpoint"
        )
    raw = t.raw[:, start // block * type_size : (start + length) // block * type_size]
    return GgufBlocks(np.ascontiguousarray(raw), t.qtype, (t.shape[0], length))


def _pad_rows(t: Weight, rows: int) -> Weight:
    missing = rows - t.shape[0]
    if missing == 0:
        return t
    if isinstance(t, GgufBlocks):  # zero bytes: scale 0, every value 0
        zeros = np.zeros((missing, t.raw.shape[1]), dtype=t.raw.dtype)
        return GgufBlocks(np.concatenate([t.raw, zeros]), t.qtype, (rows, t.shape[1]))
    return torch.cat([t, t.new_zeros(missing, *t.shape[1:])])
