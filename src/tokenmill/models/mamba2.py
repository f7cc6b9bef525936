"""Mamba2: a stack of pre-norm Mamba2 mixers, no attention; every layer's cache is a state
slot (``layers/recurrent/mamba2.Mamba2Mixer``). HF names: ``backbone.embeddings``,
``backbone.layers.N.{norm,mixer}``, ``backbone.norm_f``, ``lm_head``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.errors import ModelLoadError, UnsupportedModelError
from tokenmill.kv_cache.spec import CacheSpec
from tokenmill.layers.linear import Linear, VocabEmbedding
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import Ops, select_ops
from tokenmill.layers.recurrent.mamba2 import Mamba2Mixer, Mamba2Shape
from tokenmill.layers.recurrent.plan import StatePlan
from tokenmill.models.base import CausalLM
from tokenmill.models.weights import load_weights


def mamba2_shape(d: dict[str, Any]) -> Mamba2Shape:
    hidden = int(d["hidden_size"])
    heads, head_dim = int(d.get("num_heads", 128)), int(d.get("head_dim", 64))
    if heads * head_dim != round(d.get("expand", 2) * hidden):  # round: a TP rank's expand
        raise ModelLoadError(
            f"num_heads * head_dim = {heads * head_dim} must equal expand * hidden_size = "
            f"{round(d.get('expand', 2) * hidden)}"
        )
    groups = int(d.get("n_groups", 1))
    if heads % groups:
        raise ModelLoadError(f"num_heads={heads} is not a multiple of n_groups={groups}")
    limit = d.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Shape(
        hidden_size=hidden, num_heads=heads, head_dim=head_dim,
        state_size=int(d.get("state_size", 128)), n_groups=groups,
        conv_kernel=int(d.get("conv_kernel", 4)), conv_bias=bool(d.get("use_conv_bias", True)),
        bias=bool(d.get("use_bias", False)), eps=float(d.get("layer_norm_epsilon", 1e-5)),
        dt_limit=(float(limit[0]), float(limit[1])),
    )  # fmt: skip


class Mamba2Block(nn.Module):
    """x -> x + mixer(norm(x)); the residual in float32 when ``residual_in_fp32``."""

    def __init__(self, shape: Mamba2Shape, layer_idx: int, dtype: torch.dtype, fp32: bool,
                 ops: Ops) -> None:  # fmt: skip
        super().__init__()
        self.fp32 = fp32
        self.norm = RMSNorm(shape.hidden_size, shape.eps, dtype=dtype, ops=ops)
        self.mixer = Mamba2Mixer(shape, layer_idx, dtype, scan=ops.scan)

    def forward(self, x: torch.Tensor, ctx: StepContext, plan: StatePlan) -> torch.Tensor:
        out = self.mixer(self.norm(x.to(self.norm.weight.dtype)), ctx, plan)
        return (x.float() if self.fp32 else x) + out


class Mamba2ForCausalLM(CausalLM):
    takes_quant_plan = False

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 max_positions: int | None = None, quant: Any = None,
                 ops: Ops | None = None) -> None:  # fmt: skip
        super().__init__()
        if quant is not None:
            raise UnsupportedModelError("quantized weights are not supported for Mamba2 yet")
        shape = mamba2_shape(hf_config)
        self.dtype = dtype
        self.ops = ops or select_ops(torch.get_default_device(), dtype)
        self.num_layers = int(hf_config["num_hidden_layers"])
        self.vocab_size = int(hf_config["vocab_size"])
        # No paged layer: the engine's block count (still sized from these) only bounds
        # the bookkeeping of token positions, so one "head" of hidden_size per layer.
        self.num_kv_heads, self.head_dim = 1, shape.hidden_size
        fp32 = bool(hf_config.get("residual_in_fp32", True))
        self.embeddings = VocabEmbedding(self.vocab_size, shape.hidden_size, dtype)
        self.layers = nn.ModuleList(
            Mamba2Block(shape, i, dtype, fp32, self.ops) for i in range(self.num_layers)
        )
        self.norm_f = RMSNorm(shape.hidden_size, shape.eps, dtype=dtype, ops=self.ops)
        tied = bool(hf_config.get("tie_word_embeddings", False))
        self.lm_head = None if tied else Linear(shape.hidden_size, self.vocab_size, False, dtype)

    def cache_specs(self) -> list[CacheSpec]:
        layers: list[Mamba2Block] = list(self.layers)  # type: ignore[arg-type]
        return [layer.mixer.state_spec for layer in layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        plan = StatePlan.of(ctx)
        for layer in self.layers:
            hidden = layer(hidden, ctx, plan)
        return self.norm_f(hidden.to(self.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.embeddings.logits(hidden).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.weight",) if self.lm_head is None else ()
        renamed = (
            (n.removeprefix("backbone.").replace("embedding.", "embeddings."), t)
            for n, t in weights
        )
        return load_weights(self, renamed, skip=skip, packed={})
