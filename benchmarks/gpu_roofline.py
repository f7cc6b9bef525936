"""Hardware limits of a Llama-shaped model: FLOPs and bytes per prefill and decode step.

Counts (bf16 weights and KV, 2 FLOPs per multiply-add): every linear weight is read once
per step and multiplied with every token of the step; logits only for the rows that
sample; attention costs 4 H D FLOPs per (query, visible key) pair and per layer, and a
decode step reads the K/V of every context token once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    elem: int = 2
    """Bytes per weight / KV element."""

    @classmethod
    def from_hf(cls, cfg: dict, elem: int = 2) -> Shape:
        heads = cfg["num_attention_heads"]
        return cls(
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            elem=elem,
        )

    @property
    def linear_params(self) -> int:
        """q, k, v, o and the gated MLP of every layer (no embedding, no head)."""
        h, d = self.hidden, self.head_dim
        attn = h * d * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * h * self.intermediate)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.elem

    def attention_flops(self, queries: int, keys: int) -> float:
        return 4.0 * self.layers * self.heads * self.head_dim * queries * keys

    def prefill_flops(self, lens: list[int]) -> float:
        """Whole prompts of ``lens`` tokens, causal, one sampled row each."""
        flops = 0.0
        for s in lens:
            flops += 2.0 * self.linear_params * s + 2.0 * self.head_params
            flops += self.attention_flops(1, s * (s + 1) // 2)
        return flops

    def decode_step(self, batch: int, context: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one decode step of ``batch`` sequences of ``context`` tokens."""
        flops = 2.0 * batch * (self.linear_params + self.head_params)
        flops += self.attention_flops(batch, context)
        weights = (self.linear_params + self.head_params) * self.elem
        return flops, weights + batch * context * self.kv_bytes_per_token

    def decode_step_seconds(
        self, batch: int, context: int, flops_s: float, bytes_s: float
    ) -> float:
        flops, nbytes = self.decode_step(batch, context)
        return max(flops / flops_s, nbytes / bytes_s)

    def offline_seconds(
        self, n: int, prompt: int, out: int, flops_s: float, bytes_s: float
    ) -> float:
        """n requests: one prefill of all prompts (their first token), then out - 1 decode
        steps of all n, each at its compute or memory limit, whichever is slower."""
        total = self.prefill_flops([prompt] * n) / flops_s
        for j in range(1, out):
            total += self.decode_step_seconds(n, prompt + j, flops_s, bytes_s)
        return total
