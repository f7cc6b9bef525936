"""Multi-token-prediction (MTP) layers inside the target's own checkpoint.

A checkpoint that says ``num_nextn_predict_layers`` >= 1 carries, next to its decoder,
layers trained to predict one token further. The layout here is MiMo's (Xiaomi MiMo-7B,
``MiMoForCausalLM``: a Qwen2 decoder plus ``model.mtp_layers.N.*``):

    e = token_layernorm(embed(t[i+1]))      (0 at position 0)
    h = hidden_layernorm(feature[i])        (the target's final hidden state at i)
    x = input_proj([h | e])                 [T, 2H] -> [T, H]
    x = decoder_layer(x) + its residual     (one Qwen2 layer, q/k/v biases)
    out = final_layernorm(x)                (logits through the target's output head)

``out`` is also the feature of the next draft position (one layer drafts all k tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tokenmill.attention import StepContext
from tokenmill.errors import ModelLoadError
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import Ops
from tokenmill.models.decoder import DecoderForCausalLM, DecoderLayer
from tokenmill.models.mimo import MTP_PREFIX as PREFIX
from tokenmill.models.weights import load_weights
from tokenmill.spec_decode.heads.base import HeadModule


def mtp_layer_count(hf_config: dict[str, Any]) -> int:
    return int(hf_config.get("num_nextn_predict_layers") or 0)


class MTPHead(HeadModule):
    """``SpecHead`` of the first MTP layer of a MiMo-layout checkpoint."""

    name = "mtp"
    feature_layers: tuple[int, ...] = ()

    def __init__(
        self,
        hf_config: dict[str, Any],
        target: DecoderForCausalLM,
        dtype: torch.dtype,
        max_positions: int,
        ops: Ops | None = None,
    ) -> None:
        super().__init__(hf_config, dtype, max_positions, ops)
        cfg, ops = self.config, self.ops
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps, dtype=dtype, ops=ops)
        self.hidden_layernorm = RMSNorm(h, eps, dtype=dtype, ops=ops)
        self.input_proj = Linear(2 * h, h, False, dtype)
        self.layer = DecoderLayer(cfg, target.spec, 0, self.rotary, dtype, None, ops)
        self.final_layernorm = RMSNorm(h, eps, dtype=dtype, ops=ops)
        self._target = (target,)  # a tuple: not a submodule (its weights are the target's)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
        features: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        target = self._target[0]
        embeds = target.model.embed_tokens(input_ids).to(self.dtype)  # [T, H]
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        x = self.input_proj(
            torch.cat((self.hidden_layernorm(features.to(self.dtype)),
                       self.token_layernorm(embeds)), dim=-1)
        )  # fmt: skip
        rope = {self.rotary: self.rotary.tables(positions)}
        hidden, residual = self.layer(rope, x, None, ctx)
        out = self.final_layernorm(hidden + residual)
        return out, out

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden).argmax(dim=-1)

    def draft_topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        lp = torch.log_softmax(self._target[0].compute_logits(hidden), dim=-1)
        best, ids = lp.topk(k, dim=-1)
        return ids, best

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the layer from the target checkpoint's ``model.mtp_layers.0.*`` tensors."""
        first = f"{PREFIX}0."

        def mine() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(first):
                    continue
                rest = name[len(first) :]
                top = rest.split(".", 1)[0]
                if top not in ("token_layernorm", "hidden_layernorm", "input_proj",
                               "final_layernorm"):  # fmt: skip
                    rest = f"layer.{rest}"  # the decoder layer's own tensors
                yield rest, tensor.to(self.dtype)

        filled = load_weights(self, mine())
        if not filled:
            raise ModelLoadError(
                f"the checkpoint says num_nextn_predict_layers >= 1 but has no {first}* tensors"
            )
