"""Tensor parallelism for the recurrent layers: each rank holds a slice of the heads (and
of their state), as ``shard.TPShard`` does for attention heads.

- Gated DeltaNet (Qwen3.5 / Qwen3-Next): rank r of n holds key heads [r Hk/n, ...) and the
  value heads they serve ([r Hv/n, ...): contiguous, so each key head keeps its group of
  value heads); the conv channels of q, k and v in the same order; z, b, a, dt_bias, A_log
  per value head. The gated norm is per value head (replicated weight), the output
  projection row-parallel. State per rank: [Hv/n, K, V] and its conv window.
- Mamba2 (and Falcon-H1's mixer): heads [r H/n, ...) with their z, x rows, dt, A_log, D,
  dt_bias and norm weight; the groups of B / C that those heads read: G/n of them, or
  with fewer groups than ranks the one group (replicated, like KV heads). The gated
  RMSNorm normalizes over each group (HF's ``group_size = inner / n_groups``): with
  whole groups on a rank it is local, with a group spread over ranks their sums of squares
  are summed (``SpreadGroupNorm``).
- LFM2's short conv: channels [r h/n, ...) of B, C, x and of the depthwise conv.

Each family's ``HybridSplit`` gives its size checks, its rank's config.json entries (the
model is built at those sizes) and its weight rules, keyed by the module path inside a
layer ("mixer.in_proj"; "mixer" for parameters of the mixer itself: A_log, D, dt_bias).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.distributed.config import attention_problems
from tokenmill.layers.recurrent.mamba2 import GroupedGatedRMSNorm, Mamba2Shape

if TYPE_CHECKING:
    from tokenmill.distributed.group import RankGroup
    from tokenmill.distributed.shard import TPShard

Rule = Callable[["TPShard", str, torch.Tensor], torch.Tensor]
Pieces = Callable[["TPShard"], list[tuple[int, int]]]
"""A rank's rows of a tensor: (start, length) ranges, concatenated in order."""


@dataclass(frozen=True)
class HybridSplit:
    problems: Callable[[int], list[str]]
    """Why ``n`` ranks can not split the model ([]: they can)."""
    local: Callable[[int], dict[str, Any]]
    """config.json entries at ``n`` ranks' sizes (over ``TPShard.local_hf_config``'s)."""
    rules: Mapping[str, Rule]
    """In-layer module path -> its tensors' rule (others: ``shard``'s rules by leaf)."""
    row_parallel: tuple[str, ...] = ("out_proj",)
    """Built module leaves whose input is split (summed over ranks)."""
    norm_groups: Callable[[int, int], tuple[int, int, int] | None] = lambda rank, n: None
    """(groups, this rank's group, its width) when a gated norm's groups spread over ranks."""


def _take(pieces: Pieces) -> Rule:
    """Rows (weights [out, in], biases, vectors) from ``pieces`` of the rank."""

    def rule(s: TPShard, kind: str, t: torch.Tensor) -> torch.Tensor:
        parts = [t.narrow(0, a, n) for a, n in pieces(s)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return rule


def _cols(width: Callable[[TPShard], int]) -> Rule:
    """A row-parallel projection: input columns [r w, (r + 1) w); the bias on rank 0."""

    def rule(s: TPShard, kind: str, t: torch.Tensor) -> torch.Tensor:
        if kind == "bias":
            return t if s.rank == 0 else torch.zeros_like(t)
        w = width(s)
        return t.narrow(1, s.rank * w, w)

    return rule


def _problem(name: str, value: int, n: int) -> list[str]:
    return [f"{name}={value} is not divisible by {n}"] if value % n else []


# -- Mamba2 heads and groups --------------------------------------------------------------


@dataclass(frozen=True)
class MambaCut:
    """One rank's heads and groups of a Mamba2 mixer."""

    shape: Mamba2Shape
    rank: int
    size: int

    @property
    def heads(self) -> int:
        return self.shape.num_heads // self.size

    @property
    def head_rows(self) -> int:
        return self.heads * self.shape.head_dim

    @property
    def groups(self) -> int:
        return max(1, self.shape.n_groups // self.size)

    @property
    def first_group(self) -> int:
        g, n = self.shape.n_groups, self.size
        return self.rank * self.groups if g >= n else self.rank // (n // g)

    def xbc(self, at: int) -> list[tuple[int, int]]:
        """x, B, C rows of a tensor whose x rows start at ``at`` (in_proj: after z)."""
        s, gn = self.shape, self.shape.n_groups * self.shape.state_size
        b = at + s.inner + self.first_group * s.state_size
        width = self.groups * s.state_size
        return [(at + self.rank * self.head_rows, self.head_rows), (b, width), (b + gn, width)]

    def in_proj(self) -> list[tuple[int, int]]:
        s = self.shape
        dt = 2 * s.inner + 2 * s.n_groups * s.state_size
        return [(self.rank * self.head_rows, self.head_rows), *self.xbc(s.inner),
                (dt + self.rank * self.heads, self.heads)]  # fmt: skip


def mamba_problems(shape: Mamba2Shape, n: int) -> list[str]:
    g = shape.n_groups
    problems = _problem("num_heads", shape.num_heads, n)
    if (g % n) if g >= n else (n % g):
        problems.append(f"n_groups={g} neither divides nor is divisible by {n}")
    return problems


def mamba_rules(shape: Mamba2Shape, prefix: str) -> dict[str, Rule]:
    def cut(s: TPShard) -> MambaCut:
        return MambaCut(shape, s.rank, s.size)

    per_head: Pieces = lambda s: [(s.rank * cut(s).heads, cut(s).heads)]  # noqa: E731
    return {
        f"{prefix}.in_proj": _take(lambda s: cut(s).in_proj()),
        f"{prefix}.conv1d": _take(lambda s: cut(s).xbc(0)),
        prefix: _take(per_head),  # dt_bias, A_log, D
        f"{prefix}.norm": _take(lambda s: [(s.rank * cut(s).head_rows, cut(s).head_rows)]),
        f"{prefix}.out_proj": _cols(lambda s: cut(s).head_rows),
    }


def mamba_norm_groups(shape: Mamba2Shape) -> Callable[[int, int], tuple[int, int, int] | None]:
    def groups(rank: int, n: int) -> tuple[int, int, int] | None:
        if shape.n_groups >= n:
            return None  # whole groups on every rank: the norm is local
        cut = MambaCut(shape, rank, n)
        return shape.n_groups, cut.first_group, shape.inner // shape.n_groups

    return groups


class SpreadGroupNorm(GroupedGatedRMSNorm):
    """The grouped gated RMSNorm of a mixer whose one group spans several ranks: this
    rank's slice y [T, inner / n] is part of group ``group`` (of ``num_groups``, each
    ``width`` wide); the mean square is the all-reduced sum over the group's ranks."""

    tp: RankGroup
    num_groups: int
    group: int
    width: int

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gate = torch.nn.functional.silu(z.float())
        x = y.float() * gate if self.gate_first else y.float()
        sums = torch.zeros(x.shape[0], self.num_groups, dtype=torch.float32, device=x.device)
        sums[:, self.group] = x.pow(2).sum(-1)
        mean = self.tp.all_reduce(sums)[:, self.group : self.group + 1] / self.width  # [T, 1]
        normed = x * torch.rsqrt(mean + self.eps)
        if self.gate_first:
            return self.weight * normed.to(y.dtype)
        return (self.weight * normed * gate).to(y.dtype)


def adopt_norms(model: nn.Module, split: HybridSplit, group: RankGroup) -> None:
    """Each gated norm whose groups spread over ranks becomes a ``SpreadGroupNorm``."""
    spread = split.norm_groups(group.rank, group.size)
    if spread is None:
        return
    for module in model.modules():
        if type(module) is GroupedGatedRMSNorm:
            module.__class__ = SpreadGroupNorm
            num_groups, index, width = spread
            vars(module).update(tp=group, num_groups=num_groups, group=index, width=width)


# -- the families ----------------------------------------------------------------------------


def _mamba2(hf: dict[str, Any]) -> HybridSplit:
    from tokenmill.models.mamba2 import mamba2_shape

    shape = mamba2_shape(hf)

    def local(n: int) -> dict[str, Any]:
        cut = MambaCut(shape, 0, n)
        return {"num_heads": cut.heads, "n_groups": cut.groups,
                "expand": cut.head_rows / shape.hidden_size}  # fmt: skip

    return HybridSplit(
        problems=lambda n: mamba_problems(shape, n),
        local=local,
        rules=mamba_rules(shape, "mixer"),
        norm_groups=mamba_norm_groups(shape),
    )


def _falcon_h1(hf: dict[str, Any]) -> HybridSplit:
    from tokenmill.models.config import ArchConfig
    from tokenmill.models.falcon_h1 import mixer_shape

    cfg = ArchConfig.from_hf({"tie_word_embeddings": False, **hf})
    shape = mixer_shape(hf, cfg)

    def local(n: int) -> dict[str, Any]:
        cut = MambaCut(shape, 0, n)
        return {"mamba_n_heads": cut.heads, "mamba_n_groups": cut.groups,
                "mamba_d_ssm": cut.head_rows, "mamba_d_head": shape.head_dim}  # fmt: skip

    norm = mamba_norm_groups(shape) if hf.get("mamba_rms_norm", False) else (lambda r, n: None)
    return HybridSplit(
        problems=lambda n: attention_problems(cfg, n) + mamba_problems(shape, n),
        local=local,
        rules=mamba_rules(shape, "mamba"),
        norm_groups=norm,
    )


def _qwen3_5(hf: dict[str, Any]) -> HybridSplit:
    from tokenmill.models.qwen3_5 import HybridConfig

    cfg = HybridConfig.from_hf(hf)
    d = cfg.deltanet
    group = d.num_v_heads // d.num_k_heads

    def kh(s: TPShard) -> int:  # key heads per rank
        return d.num_k_heads // s.size

    def vrows(s: TPShard, at: int = 0, per: int = d.head_v_dim) -> tuple[int, int]:
        n = d.num_v_heads // s.size
        return (at + s.rank * n * per, n * per)

    def qkv(s: TPShard) -> list[tuple[int, int]]:
        k = kh(s) * d.head_k_dim
        return [(s.rank * k, k), (d.key_dim + s.rank * k, k), vrows(s, 2 * d.key_dim)]

    grouped = 2 * d.head_k_dim + 2 * group * d.head_v_dim  # Qwen3-Next's rows per key head
    rules: dict[str, Rule] = {
        "linear_attn.in_proj_qkv": _take(qkv),
        "linear_attn.conv1d": _take(qkv),
        "linear_attn.in_proj_z": _take(lambda s: [vrows(s)]),
        "linear_attn.in_proj_b": _take(lambda s: [vrows(s, per=1)]),
        "linear_attn.in_proj_a": _take(lambda s: [vrows(s, per=1)]),
        "linear_attn": _take(lambda s: [vrows(s, per=1)]),  # dt_bias, A_log
        "linear_attn.in_proj_qkvz": _take(lambda s: [(s.rank * kh(s) * grouped, kh(s) * grouped)]),
        "linear_attn.in_proj_ba": _take(
            lambda s: [(s.rank * kh(s) * 2 * group, kh(s) * 2 * group)]
        ),
        "linear_attn.out_proj": _cols(lambda s: vrows(s)[1]),
        # gated attention: q and its gate interleaved per head, 2 * head_dim rows each
        "self_attn.q_proj": _take(
            lambda s: [(s.rank * s.heads * 2 * s.cfg.head_dim, s.heads * 2 * s.cfg.head_dim)]
        ),  # fmt: skip
    }
    return HybridSplit(
        problems=lambda n: (
            attention_problems(cfg.arch, n) + _problem("linear_num_key_heads", d.num_k_heads, n)
        ),
        local=lambda n: {
            "linear_num_key_heads": d.num_k_heads // n,
            "linear_num_value_heads": d.num_v_heads // n,
        },  # fmt: skip
        rules=rules,
    )


def _lfm2(hf: dict[str, Any]) -> HybridSplit:
    from tokenmill.models.config import ArchConfig
    from tokenmill.models.lfm2 import ffn_size

    cfg = ArchConfig.from_hf({"rms_norm_eps": hf.get("norm_eps", 1e-5), **hf})
    h, ffn = cfg.hidden_size, ffn_size(hf)

    def channels(s: TPShard, at: int = 0) -> tuple[int, int]:
        c = h // s.size
        return (at + s.rank * c, c)

    def ffn_rows(s: TPShard) -> list[tuple[int, int]]:
        return [(s.rank * (ffn // s.size), ffn // s.size)]

    rules: dict[str, Rule] = {
        "conv.in_proj": _take(lambda s: [channels(s), channels(s, h), channels(s, 2 * h)]),
        "conv.conv": _take(lambda s: [channels(s)]),
        "conv.out_proj": _cols(lambda s: h // s.size),
        "self_attn.out_proj": _cols(lambda s: s.heads * s.cfg.head_dim),
        "feed_forward.w1": _take(ffn_rows),
        "feed_forward.w3": _take(ffn_rows),
        "feed_forward.w2": _cols(lambda s: ffn // s.size),
    }
    return HybridSplit(
        problems=lambda n: (
            attention_problems(cfg, n, mlp=False)
            + _problem("hidden_size (the short conv's channels)", h, n)
            + _problem("the feed-forward width", ffn, n)
        ),
        local=lambda n: {
            "conv_channels": h // n,
            "block_auto_adjust_ff_dim": False,
            "intermediate_size": ffn // n,
        },  # fmt: skip
        rules=rules,
    )


SPLITS: dict[str, Callable[[dict[str, Any]], HybridSplit]] = {
    "Qwen3_5ForCausalLM": _qwen3_5,
    "Qwen3NextForCausalLM": _qwen3_5,
    "Qwen3_5ForConditionalGeneration": _qwen3_5,  # given the text_config (Family.text)
    "Mamba2ForCausalLM": _mamba2,
    "Lfm2ForCausalLM": _lfm2,
    "FalconH1ForCausalLM": _falcon_h1,
}
"""Model class name -> its recurrent layers' split (the decoders: none, ``shard`` alone)."""


def split_of(model_cls: type, hf: dict[str, Any]) -> HybridSplit | None:
    make = SPLITS.get(model_cls.__name__)
    return None if make is None else make(hf)
