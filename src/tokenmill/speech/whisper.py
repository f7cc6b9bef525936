"""Whisper's encoder and decoder (module names follow HF's, so its checkpoints load as-is).

The decoder reads and writes a ``DecoderCache``: per-row self-attention K/V of the text
so far and the cross-attention K/V of that row's encoder output, computed once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.native import dense16
from tokenmill.quant.dense16 import NativeLinear, swap_float32_linears
from tokenmill.speech.config import WhisperConfig
from tokenmill.speech.native_step import NativeDecoder

VOCAB_BLOCKS = 4
"""Row blocks of the output projection, multiplied as one batched matmul (``vocab_logits``)."""


def vocab_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, D] @ weight [V, D].T -> logits [M, V], equal to the plain matmul up to rounding.

    A decode step has M = live rows (1..16). MKL's matmul with so few rows reads the
    table at ~10 GB/s on this CPU (tiny.en's 80 MB fp32 table: 8.3 ms at M = 1, 13 ms
    at M = 4, on 2 cores), while a batched matmul over 4 row blocks of the table runs
    near the memory bandwidth (2.0 ms and 3.3 ms). The V % 4 last rows go alone.
    """
    m, (v, d) = x.shape[0], weight.shape
    n = v // VOCAB_BLOCKS
    blocks = weight[: n * VOCAB_BLOCKS].view(VOCAB_BLOCKS, n, d)
    out = torch.bmm(blocks, x.T.expand(VOCAB_BLOCKS, d, m)).view(n * VOCAB_BLOCKS, m).T
    if v % VOCAB_BLOCKS:
        out = torch.cat((out, x @ weight[n * VOCAB_BLOCKS :].T), dim=1)
    return out.contiguous()


FEW_ROWS = 16
"""A linear over at most this many rows (a decode step) goes through ``vocab_logits``."""


def pack_native(model: Whisper) -> int:
    """Where the native float32 kernel beats PyTorch's BLAS (``dense16.fp32_native``),
    every float32 linear of ``model`` becomes a ``NativeLinear`` and the decoder's output
    head (tied to the token table) gets one too; the number of layers packed."""
    if not dense16.fp32_native():
        return 0
    packed = swap_float32_linears(model)
    table = model.decoder.embed_tokens.weight
    if table.dtype == torch.float32:
        model.decoder.head = NativeLinear(table)
        packed += 1
    model.decoder.native = NativeDecoder.build(model.decoder, model.cfg.heads)
    return packed


def linear(layer: nn.Linear | NativeLinear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for x [..., D], equal up to rounding. A ``NativeLinear`` (``pack_native``)
    multiplies itself. Else, with few rows, the weight is read as row blocks of one batched
    matmul, as ``vocab_logits`` reads the table: the decoder's 32 linears (33 MB) took 8.8 ms
    as plain matmuls and 4.1-6.7 ms so, at 1-2 rows, weights not in cache, on one core (AVX2
    Xeon)."""
    if isinstance(layer, NativeLinear):
        return layer(x)
    rows = x.numel() // x.shape[-1]
    if rows > FEW_ROWS or layer.out_features % VOCAB_BLOCKS:
        return layer(x)
    out = vocab_logits(x.reshape(rows, -1), layer.weight)
    if layer.bias is not None:
        out += layer.bias
    return out.view(*x.shape[:-1], -1)


class Attention(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, H, T, Dh]"""
        b, t, _ = x.shape
        return x.view(b, t, self.heads, -1).transpose(1, 2)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, Dh] -> [B, T, D] through out_proj"""
        b, _, t, _ = x.shape
        return linear(self.out_proj, x.transpose(1, 2).reshape(b, t, -1))

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(linear(self.k_proj, x)), self.split(linear(self.v_proj, x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.kv(h)
        q = self.self_attn.split(linear(self.self_attn.q_proj, h))
        x = x + self.self_attn.merge(F.scaled_dot_product_attention(q, k, v))
        return x + linear(self.fc2, F.gelu(linear(self.fc1, self.final_layer_norm(x))))


class Encoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.d_model, 3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, 3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """[B, n_mels, 3000] -> [B, 1500, D]"""
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class DecoderCache:
    """K/V for ``rows`` decoding rows: self [L, rows, H, max_len, Dh], cross [L, rows, H, 1500, Dh].

    Live rows are kept contiguous (``move`` packs a finished row's slot with the last
    live one), so a batched step reads plain slices, never a gather.
    """

    def __init__(self, cfg: WhisperConfig, rows: int, dtype: torch.dtype) -> None:
        shape = (cfg.decoder_layers, rows, cfg.heads)
        self.self_k = torch.zeros(*shape, cfg.max_target_positions, cfg.head_dim, dtype=dtype)
        self.self_v = torch.zeros_like(self.self_k)
        self.cross_k = torch.zeros(*shape, cfg.max_source_positions, cfg.head_dim, dtype=dtype)
        self.cross_v = torch.zeros_like(self.cross_k)

    def move(self, src: int, dst: int) -> None:
        for t in (self.self_k, self.self_v, self.cross_k, self.cross_v):
            t[:, dst] = t[:, src]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.encoder_attn = Attention(cfg)
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(
        self,
        x: torch.Tensor,
        i: int,
        cache: DecoderCache,
        rows: slice,
        pos: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, D]; pos [B, T] cache positions written; mask [B, 1, T, Lk] keys visible."""
        b = x.shape[0]
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.kv(h)
        sk, sv = cache.self_k[i, rows], cache.self_v[i, rows]  # views [B, H, max_len, Dh]
        row = torch.arange(b)[:, None]
        sk[row, :, pos] = k.transpose(1, 2)  # [B, T, H, Dh] into its positions
        sv[row, :, pos] = v.transpose(1, 2)
        lk = mask.shape[-1]
        q = self.self_attn.split(linear(self.self_attn.q_proj, h))
        a = F.scaled_dot_product_attention(q, sk[:, :, :lk], sv[:, :, :lk], attn_mask=mask)
        x = x + self.self_attn.merge(a)
        h = self.encoder_attn_layer_norm(x)
        q = self.encoder_attn.split(linear(self.encoder_attn.q_proj, h))
        a = F.scaled_dot_product_attention(q, cache.cross_k[i, rows], cache.cross_v[i, rows])
        x = x + self.encoder_attn.merge(a)
        h = F.gelu(linear(self.fc1, self.final_layer_norm(x)))
        return x + linear(self.fc2, h)


class Decoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)
        self.head: NativeLinear | None = None
        """The output projection (the token table, tied) in native tiles (``pack_native``)."""
        self.native: NativeDecoder | None = None
        """The layers stepped in native code, one call each, for decode steps (``pack_native``)."""

    def set_cross(self, enc: torch.Tensor, cache: DecoderCache, rows: slice) -> None:
        """Store the cross-attention K/V of ``enc`` [B, 1500, D] in ``rows``."""
        for i, layer in enumerate(self.layers):
            k, v = layer.encoder_attn.kv(enc)
            cache.cross_k[i, rows] = k
            cache.cross_v[i, rows] = v

    def forward(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        cache: DecoderCache,
        rows: slice,
        at: list[int] | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] at positions start[b] + t -> logits [B, V] of the last position, or
        [B, len(at), V] of the input positions ``at``."""
        t = tokens.shape[1]
        if self.native is not None and t == 1 and at is None and not rows.start:
            x = (self.embed_tokens(tokens[:, 0]) + self.embed_positions(start)).contiguous()
            return self.logits(self.layer_norm(self.native.step(x, start, cache)))
        pos = start[:, None] + torch.arange(t)  # [B, T]
        lk = int(pos.max()) + 1
        mask = (torch.arange(lk)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, Lk]
        x = self.embed_tokens(tokens) + self.embed_positions(pos)
        for i, layer in enumerate(self.layers):
            x = layer(x, i, cache, rows, pos, mask)
        x = self.layer_norm(x[:, -1] if at is None else x[:, at])  # [B, D] or [B, A, D]
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., V]"""
        if self.head is not None:
            return self.head(x)
        logits = vocab_logits(x.reshape(-1, x.shape[-1]), self.embed_tokens.weight)
        return logits.view(*x.shape[:-1], -1)


class Whisper(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
