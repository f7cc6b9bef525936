"""EAGLE-3 heads, loaded from the published head folder (``config.json`` + weights).

The head drafts token t[i+2] at position i from the embedding of t[i+1] and a feature of
position i: for positions the target computed, ``fc`` of the residual stream in front of
three target layers ([T, 3 * target hidden]); for its own drafts, its previous output
(before the final norm). One Llama decoder layer whose attention reads
[input_norm(embedding) | hidden_norm(feature)] (2 x hidden), its own final norm and an
output head over a reduced draft vocabulary; ``d2t`` maps a draft id to its target id
(target = draft + d2t[draft]).

Weight names as published: ``fc``, ``midlayer.*`` (or ``layers.0.*``), ``norm``,
``lm_head``, ``d2t`` / ``t2d`` and optionally ``embed_tokens`` (otherwise the target's
embedding is shared).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.errors import ModelLoadError
from tokenmill.layers.attention import Attention, AttentionSpec
from tokenmill.layers.linear import Linear, VocabEmbedding
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import Ops
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.weights import load_weights
from tokenmill.spec_decode.heads.base import HeadModule

_RENAMES = (("model.layers.0.", "midlayer."), ("layers.0.", "midlayer."), ("model.", ""))
_OWN = ("d2t", "t2d", "embed_tokens.weight")
"""Tensors read here, not streamed into parameters."""


def aux_layer_ids(hf_config: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input stream the head reads: the config's
    ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``), else
    (2, L // 2, L - 3) as EAGLE-3 trains them."""
    ids = hf_config.get("eagle_aux_hidden_state_layer_ids") or (
        hf_config.get("eagle_config") or {}
    ).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        n = num_target_layers
        ids = [2, n // 2, n - 3]
    layers = tuple(int(i) for i in ids)
    if (
        len(set(layers)) != 3
        or list(layers) != sorted(layers)
        or not all(0 <= i < num_target_layers for i in layers)
    ):
        raise ModelLoadError(
            f"EAGLE-3 head: eagle_aux_hidden_state_layer_ids {list(layers)} must be three "
            f"increasing layer indices of the target's {num_target_layers} layers"
        )
    return layers


class Eagle3Layer(nn.Module):
    """One Llama layer over [embedding | feature]: (embeds, feature) [T, H] -> the layer's
    MLP output and the residual stream (feature + attention)."""

    def __init__(
        self, cfg: ArchConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        spec = AttentionSpec(
            hidden_size=h, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, scale=cfg.head_dim**-0.5, qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias, input_size=2 * h,
        )  # fmt: skip
        self.self_attn = Attention(spec, 0, rotary, dtype, None, "midlayer.self_attn", ops)
        self.mlp = GatedMLP(
            h, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, dtype, None, "midlayer.mlp", ops
        )
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, ops=ops)


class Eagle3Head(HeadModule):
    """``SpecHead`` of an EAGLE-3 checkpoint (see the module docstring)."""

    name = "eagle3"
    d2t: torch.Tensor  # [draft vocab] int64: target id - draft id

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
        target_hidden = int(hf_config.get("target_hidden_size") or target.config.hidden_size)
        self.feature_layers = aux_layer_ids(hf_config, target.num_layers)
        self.draft_vocab_size = int(hf_config.get("draft_vocab_size") or cfg.vocab_size)
        self.fc = Linear(3 * target_hidden, cfg.hidden_size, False, dtype)
        self.midlayer = Eagle3Layer(cfg, self.rotary, dtype, ops)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.lm_head = Linear(cfg.hidden_size, self.draft_vocab_size, False, dtype)
        self.embed_tokens: VocabEmbedding | None = None
        """The head's own embedding when its checkpoint has one, else the target's."""
        self._target_embed = (target.model.embed_tokens,)  # a tuple: not a submodule
        self.register_buffer(
            "d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False
        )
        self.target_vocab_size = target.vocab_size

    # -- SpecHead -------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
        features: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        layer = self.midlayer
        embed = self.embed_tokens or self._target_embed[0]
        embeds = embed(input_ids).to(self.dtype)  # [T, H]
        if features.shape[-1] != self.config.hidden_size:  # the target's: [T, 3 H_t]
            residual = self.fc(features.to(self.dtype))
        else:  # its own previous output (kept by the caller: not written in place)
            residual = features.clone()
        joined = torch.cat(
            (layer.input_layernorm(embeds), layer.hidden_norm(residual)), dim=-1
        )  # [T, 2H]
        attn = layer.self_attn(self.rotary.tables(positions), joined, ctx)
        hidden, residual = layer.post_attention_layernorm.forward_residual(attn, residual)
        stream = layer.mlp(hidden) + residual  # [T, H], before the final norm
        return self.norm(stream), stream

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        best = self.lm_head(hidden).float().argmax(dim=-1)  # [N] draft-vocabulary ids
        return best + self.d2t[best]

    def draft_topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        lp = torch.log_softmax(self.lm_head(hidden).float(), dim=-1)
        best, ids = lp.topk(k, dim=-1)  # [N, k] in the draft vocabulary
        return ids + self.d2t[ids], best

    # -- loading --------------------------------------------------------------------------
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the head from its checkpoint's (name, tensor) stream."""
        own: dict[str, torch.Tensor] = {}

        def layer_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for raw, tensor in weights:
                name = _rename(raw)
                if name in _OWN:
                    own[name] = tensor
                else:
                    yield name, tensor.to(self.dtype)

        load_weights(self, layer_weights(), skip=())
        if "embed_tokens.weight" in own:
            table = own["embed_tokens.weight"]
            self.embed_tokens = VocabEmbedding(table.shape[0], table.shape[1], self.dtype).to(
                self.d2t.device
            )
            self.embed_tokens.load_weight(table.to(self.dtype))
        if "d2t" in own:
            d2t = own["d2t"].to(torch.int64)
            if d2t.shape != self.d2t.shape:
                raise ModelLoadError(
                    f"EAGLE-3 head: d2t has shape {list(d2t.shape)}, expected "
                    f"[{self.draft_vocab_size}] (draft_vocab_size)"
                )
            self.d2t.copy_(d2t)
        targets = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        if int(targets.max()) >= self.target_vocab_size or int(targets.min()) < 0:
            raise ModelLoadError(
                "EAGLE-3 head: d2t maps draft ids past the target's vocabulary "
                f"({self.target_vocab_size} tokens); is this the head of another model?"
            )


def _rename(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def read_head_folder(
    folder: str | Path,
) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """(config.json, the weight stream) of an EAGLE-3 head folder: model.safetensors (or
    shards) or the pytorch_model.bin the reference heads were published as."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"EAGLE-3 head {path}: no config.json; pass the head's folder as speculative_config"
            "['model']"
        )
    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                        yield name, f.get_tensor(name)

        return config, stream()
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise ModelLoadError(
            f"EAGLE-3 head {path}: no *.safetensors or pytorch_model.bin next to config.json"
        )

    def stream_bin() -> Iterator[tuple[str, torch.Tensor]]:
        for file in bins:
            yield from torch.load(file, map_location="cpu", weights_only=True).items()

    return config, stream_bin()
