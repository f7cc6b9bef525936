"""ModernBERT over a packed batch: pre-norm blocks, rotary positions, GeGLU, and local
(sliding-window) attention in all but every ``global_attn_every_n_layers``-th layer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.models.bert import ACTIVATIONS, PackedBatch, bidirectional_attention


def _rope_theta(cfg: dict[str, Any], layer_type: str) -> float:
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict) and params[layer_type].get("rope_theta"):
        return float(params[layer_type]["rope_theta"])
    key = "local_rope_theta" if layer_type == "sliding_attention" else "global_rope_theta"
    return float(cfg.get(key) or 10000.0)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, d] rotated by each token's position (HF's rotate-half convention)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, d / 2]
    cos = torch.cat([angles.cos()] * 2, -1)[:, None, :].to(x.dtype)
    sin = torch.cat([angles.sin()] * 2, -1)[:, None, :].to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int) -> None:
        super().__init__()
        hidden, eps, norm_bias = (
            cfg["hidden_size"],
            cfg.get("norm_eps", 1e-5),
            cfg.get("norm_bias", False),
        )
        layer_type = (cfg.get("layer_types") or [])[index] if cfg.get("layer_types") else (
            "sliding_attention" if index % cfg.get("global_attn_every_n_layers", 3) else "full_attention"
        )  # fmt: skip
        self.window = (
            cfg.get("local_attention", 128) // 2 if layer_type == "sliding_attention" else None
        )
        self.theta = _rope_theta(cfg, layer_type)
        self.num_heads = cfg["num_attention_heads"]
        bias = cfg.get("attention_bias", False)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias) if index else nn.Identity()
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.Wo = nn.Linear(hidden, hidden, bias=bias)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias)
        self.Wi = nn.Linear(hidden, 2 * cfg["intermediate_size"], bias=cfg.get("mlp_bias", False))
        self.Wo_mlp = nn.Linear(cfg["intermediate_size"], hidden, bias=cfg.get("mlp_bias", False))
        self.act = ACTIVATIONS[cfg.get("hidden_activation", "gelu")]

    def forward(self, x: torch.Tensor, batch: PackedBatch, positions: torch.Tensor) -> torch.Tensor:
        total, hidden = x.shape
        qkv = self.Wqkv(self.attn_norm(x)).view(total, 3, self.num_heads, -1)
        q, k = rotate(qkv[:, 0], positions, self.theta), rotate(qkv[:, 1], positions, self.theta)
        qkv = torch.stack([q, k, qkv[:, 2]], 1).view(total, 3 * hidden)
        x = x + self.Wo(bidirectional_attention(qkv, batch, self.num_heads, window=self.window))
        gate_in, gate = self.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.Wo_mlp(self.act(gate_in) * gate)


class ModernBertModel(nn.Module):
    """ModernBertModel: hidden states [T, H] after the final norm."""

    has_classifier = False

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.config = cfg
        hidden = cfg["hidden_size"]
        self.hidden_size = hidden
        self.max_positions = cfg["max_position_embeddings"]
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], hidden)
        eps, norm_bias = cfg.get("norm_eps", 1e-5), cfg.get("norm_bias", False)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias)
        self.layers = nn.ModuleList(
            ModernBertLayer(cfg, i) for i in range(cfg["num_hidden_layers"])
        )
        self.final_norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias)

    def forward(
        self, input_ids: torch.Tensor, batch: PackedBatch, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        positions = batch.positions()
        x = self.embed_norm(self.tok_embeddings(input_ids))
        for layer in self.layers:
            x = layer(x, batch, positions)
        return self.final_norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for hf_name, tensor in weights:
            name = _our_name(hf_name.removeprefix("model."))
            if name in params:
                if params[name].shape != tensor.shape:
                    raise ModelLoadError(
                        f"weight {name}: the checkpoint has shape {tuple(tensor.shape)}, the "
                        f"config implies {tuple(params[name].shape)}"
                    )
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} weights (e.g. {missing[0]})")


class ModernBertForSequenceClassification(ModernBertModel):
    """Pooled (cls or mean, ``classifier_pooling``) -> head (dense, act, norm) -> classifier."""

    has_classifier = True

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        hidden = cfg["hidden_size"]
        self.num_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
        self.head_dense = nn.Linear(hidden, hidden, bias=cfg.get("classifier_bias", False))
        self.head_norm = nn.LayerNorm(
            hidden, eps=cfg.get("norm_eps", 1e-5), bias=cfg.get("norm_bias", False)
        )
        self.head_act = ACTIVATIONS[cfg.get("classifier_activation", "gelu")]
        self.classifier = nn.Linear(hidden, self.num_labels)
        self.mean_pool = cfg.get("classifier_pooling", "cls") == "mean"

    def classify(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        if self.mean_pool:
            pooled = torch.segment_reduce(hidden, "mean", lengths=batch.lens)
        else:
            pooled = hidden.index_select(0, batch.starts)
        return self.classifier(self.head_norm(self.head_act(self.head_dense(pooled))))


def _our_name(name: str) -> str:
    """HF ModernBERT names -> ours (``layers.N.mlp.Wo`` is ``Wo_mlp``: two Wo per layer)."""
    name = name.replace("embeddings.tok_embeddings", "tok_embeddings").replace(
        "embeddings.norm", "embed_norm"
    )
    name = name.replace(".attn.Wqkv", ".Wqkv").replace(".attn.Wo", ".Wo")
    name = name.replace(".mlp.Wi", ".Wi").replace(".mlp.Wo", ".Wo_mlp")
    return name.replace("head.dense", "head_dense").replace("head.norm", "head_norm")
