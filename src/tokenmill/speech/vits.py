"""Piper's VITS (inference direction only), with module names matching the ONNX initializers.

phoneme ids -> text encoder (relative-position attention) -> stochastic duration
predictor (reverse flows with rational-quadratic splines) -> expand to frames -> prior
sample -> reverse coupling flows -> HiFi-GAN generator -> waveform in [-1, 1].
Tensors are [B, C, T] (channels first) throughout, as in the original.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.speech.spline import inverse_rq_spline

LRELU = 0.1


@dataclass(frozen=True)
class VitsConfig:
    n_vocab: int = 256
    hidden: int = 192
    inter: int = 192
    filter: int = 768
    heads: int = 2
    layers: int = 6
    window: int = 4
    upsample_initial: int = 256
    upsample_rates: tuple[int, ...] = (8, 8, 4)
    upsample_kernels: tuple[int, ...] = (16, 16, 8)
    resblock_kernels: tuple[int, ...] = (3, 5, 7)
    resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 2), (2, 6), (3, 12))


class LayerNorm(nn.Module):
    """Over channels of [B, C, T]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(
            x.transpose(1, -1), x.shape[1:2], self.gamma, self.beta, 1e-5
        ).transpose(1, -1)


class RelativeAttention(nn.Module):
    """Self-attention with learned relative-position keys/values within +-``window``."""

    def __init__(self, ch: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window, self.dk = heads, window, ch // heads
        self.conv_q, self.conv_k, self.conv_v, self.conv_o = (
            nn.Conv1d(ch, ch, 1) for _ in range(4)
        )
        self.emb_rel_k = nn.Parameter(torch.zeros(1, 2 * window + 1, self.dk))
        self.emb_rel_v = nn.Parameter(torch.zeros(1, 2 * window + 1, self.dk))

    def _rel(self, emb: torch.Tensor, t: int) -> torch.Tensor:
        """[1, 2w+1, dk] -> [1, 2t-1, dk]: relative offsets -(t-1)..(t-1), zero beyond the window."""
        pad = max(t - (self.window + 1), 0)
        start = max((self.window + 1) - t, 0)
        return F.pad(emb, (0, 0, pad, pad))[:, start : start + 2 * t - 1]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, H, T, dk]
            return y.view(b, self.heads, self.dk, t).transpose(2, 3)

        q = heads(self.conv_q(x)) / math.sqrt(self.dk)
        k, v = heads(self.conv_k(x)), heads(self.conv_v(x))
        scores = q @ k.transpose(-2, -1)
        rel = q @ self._rel(self.emb_rel_k, t).unsqueeze(0).transpose(-2, -1)  # [B, H, T, 2T-1]
        # relative -> absolute: score[i, j] += rel[i, j - i + T - 1]
        idx = torch.arange(t)[None, :] - torch.arange(t)[:, None] + t - 1
        scores = scores + rel.gather(-1, idx.expand(b, self.heads, t, t))
        scores = scores.masked_fill(mask == 0, -1e4)
        p = scores.softmax(-1)
        out = p @ v
        # absolute -> relative: weights by offset, then through the value embeddings
        prel = torch.zeros(b, self.heads, t, 2 * t - 1, dtype=p.dtype).scatter_(
            -1, idx.expand(b, self.heads, t, t), p
        )
        out = out + prel @ self._rel(self.emb_rel_v, t).unsqueeze(0)
        return self.conv_o(out.transpose(2, 3).reshape(b, c, t))


class FFN(nn.Module):
    def __init__(self, ch: int, filt: int, kernel: int = 3) -> None:
        super().__init__()
        self.pad = ((kernel - 1) // 2, kernel // 2)
        self.conv_1 = nn.Conv1d(ch, filt, kernel)
        self.conv_2 = nn.Conv1d(filt, ch, kernel)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv_1(F.pad(x * mask, self.pad)))
        return self.conv_2(F.pad(x * mask, self.pad)) * mask


class Encoder(nn.Module):
    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        n, h = cfg.layers, cfg.hidden
        self.attn_layers = nn.ModuleList(
            RelativeAttention(h, cfg.heads, cfg.window) for _ in range(n)
        )
        self.norm_layers_1 = nn.ModuleList(LayerNorm(h) for _ in range(n))
        self.ffn_layers = nn.ModuleList(FFN(h, cfg.filter) for _ in range(n))
        self.norm_layers_2 = nn.ModuleList(LayerNorm(h) for _ in range(n))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn_mask = mask.unsqueeze(2) * mask.unsqueeze(-1)
        x = x * mask
        for attn, n1, ffn, n2 in zip(
            self.attn_layers, self.norm_layers_1, self.ffn_layers, self.norm_layers_2
        ):
            x = n1(x + attn(x, attn_mask))
            x = n2(x + ffn(x, mask))
        return x * mask


class TextEncoder(nn.Module):
    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        self.emb = nn.Embedding(cfg.n_vocab, cfg.hidden)
        self.encoder = Encoder(cfg)
        self.proj = nn.Conv1d(cfg.hidden, cfg.inter * 2, 1)

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [B, T] -> hidden [B, H, T], prior mean and log-std [B, inter, T]"""
        x = (self.emb(ids) * math.sqrt(self.emb.embedding_dim)).transpose(1, 2)
        x = self.encoder(x * mask, mask)
        m, logs = (self.proj(x) * mask).chunk(2, dim=1)
        return x, m, logs


class DDSConv(nn.Module):
    """Dilated depth-separable convolutions (dilation kernel**i)."""

    def __init__(self, ch: int, kernel: int, n: int) -> None:
        super().__init__()
        self.convs_sep = nn.ModuleList(
            nn.Conv1d(
                ch,
                ch,
                kernel,
                groups=ch,
                dilation=kernel**i,
                padding=(kernel**i * (kernel - 1)) // 2,
            )
            for i in range(n)
        )
        self.convs_1x1 = nn.ModuleList(nn.Conv1d(ch, ch, 1) for _ in range(n))
        self.norms_1 = nn.ModuleList(LayerNorm(ch) for _ in range(n))
        self.norms_2 = nn.ModuleList(LayerNorm(ch) for _ in range(n))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None
    ) -> torch.Tensor:
        if g is not None:
            x = x + g
        for sep, one, n1, n2 in zip(self.convs_sep, self.convs_1x1, self.norms_1, self.norms_2):
            y = F.gelu(n1(sep(x * mask)))
            x = x + F.gelu(n2(one(y)))
        return x * mask


class ConvFlow(nn.Module):
    """Spline coupling on 2 channels: channel 1 transformed given channel 0 (and g)."""

    def __init__(self, filt: int, kernel: int = 3, bins: int = 10, tail: float = 5.0) -> None:
        super().__init__()
        self.bins, self.tail, self.filt = bins, tail, filt
        self.pre = nn.Conv1d(1, filt, 1)
        self.convs = DDSConv(filt, kernel, 3)
        self.proj = nn.Conv1d(filt, bins * 3 - 1, 1)

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        x0, x1 = x[:, :1], x[:, 1:]
        h = self.proj(self.convs(self.pre(x0), mask, g)) * mask  # [B, 3K-1, T]
        h = h.permute(0, 2, 1)[:, None]  # [B, 1, T, 3K-1]
        k, s = self.bins, math.sqrt(self.filt)
        x1 = inverse_rq_spline(
            x1, h[..., :k] / s, h[..., k : 2 * k] / s, h[..., 2 * k :], self.tail
        )
        return torch.cat([x0, x1], 1) * mask


class ElementwiseAffine(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.zeros(ch, 1))
        self.logs = nn.Parameter(torch.zeros(ch, 1))

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return (x - self.m) * torch.exp(-self.logs) * mask


class Flip(nn.Module):
    def reverse(
        self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None
    ) -> torch.Tensor:
        return x.flip(1)


class DurationPredictor(nn.Module):
    """VITS' stochastic duration predictor, run backwards from noise to log-durations."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.pre = nn.Conv1d(ch, ch, 1)
        self.convs = DDSConv(ch, 3, 3)
        self.proj = nn.Conv1d(ch, ch, 1)
        flows: list[nn.Module] = [ElementwiseAffine(2)]
        for _ in range(4):
            flows += [ConvFlow(ch), Flip()]
        self.flows = nn.ModuleList(flows)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x [B, H, T], noise [B, 2, T] -> log-durations [B, 1, T]"""
        g = self.proj(self.convs(self.pre(x), mask)) * mask
        order = list(reversed(self.flows))
        order = order[:-2] + [order[-1]]  # the first ConvFlow is unused at inference
        z = noise
        for flow in order:
            z = flow.reverse(z, mask, g)
        return z[:, :1]


class WN(nn.Module):
    """WaveNet-style gated residual stack (weight norm already folded in the export)."""

    def __init__(self, ch: int, kernel: int, n: int) -> None:
        super().__init__()
        self.ch = ch
        self.in_layers = nn.ModuleList(
            nn.Conv1d(ch, 2 * ch, kernel, padding=kernel // 2) for _ in range(n)
        )
        self.res_skip_layers = nn.ModuleList(
            nn.Conv1d(ch, 2 * ch if i < n - 1 else ch, 1) for i in range(n)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        last = len(self.in_layers) - 1
        for i, (inp, rs) in enumerate(zip(self.in_layers, self.res_skip_layers)):
            h = inp(x)
            acts = torch.tanh(h[:, : self.ch]) * torch.sigmoid(h[:, self.ch :])
            y = rs(acts)
            if i < last:
                x = (x + y[:, : self.ch]) * mask
                out = out + y[:, self.ch :]
            else:
                out = out + y
        return out * mask


class CouplingLayer(nn.Module):
    """Mean-only affine coupling: the second half shifted given the first."""

    def __init__(self, ch: int, hidden: int) -> None:
        super().__init__()
        self.half = ch // 2
        self.pre = nn.Conv1d(self.half, hidden, 1)
        self.enc = WN(hidden, 5, 4)
        self.post = nn.Conv1d(hidden, self.half, 1)

    def reverse(
        self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None
    ) -> torch.Tensor:
        x0, x1 = x[:, : self.half], x[:, self.half :]
        m = self.post(self.enc(self.pre(x0) * mask, mask)) * mask
        return torch.cat([x0, (x1 - m) * mask], 1)


class Flow(nn.Module):
    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        flows: list[nn.Module] = []
        for _ in range(4):
            flows += [CouplingLayer(cfg.inter, cfg.hidden), Flip()]
        self.flows = nn.ModuleList(flows)

    def reverse(self, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for flow in reversed(self.flows):
            z = flow.reverse(z, mask)
        return z


def nhwc_weight(conv: nn.Conv1d | nn.ConvTranspose1d) -> None:
    """Store the weight [O, I, K] as a view of its [O, I, 1, K] channels-last form (one copy)."""
    w4 = conv.weight.detach()[:, :, None].contiguous(memory_format=torch.channels_last)
    conv.weight = nn.Parameter(w4[:, :, 0], requires_grad=False)


def conv_nhwc(x: torch.Tensor, conv: nn.Conv1d | nn.ConvTranspose1d) -> torch.Tensor:
    """A 1-D (transposed) convolution of x [B, C, 1, T] in channels-last (NHWC) layout.

    oneDNN runs these ~1.5x faster than the same Conv1d on [B, C, T] (tiny channel counts
    over long signals: 128 channels x 20000 samples, k 3: 62 vs 94 ms on 2 cores), without
    the layout reorders around each call. The 4-D weight is a view (``nhwc_weight`` made
    the storage channels-last; any other weight is reordered by oneDNN on each call).
    """
    w = conv.weight[:, :, None]
    stride, pad, dil = (1, conv.stride[0]), (0, conv.padding[0]), (1, conv.dilation[0])  # type: ignore[index]
    if isinstance(conv, nn.ConvTranspose1d):
        return F.conv_transpose2d(x, w, conv.bias, stride, pad, dilation=dil)
    return F.conv2d(x, w, conv.bias, stride, pad, dilation=dil)


class ResBlock(nn.Module):
    def __init__(self, ch: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv1d(ch, ch, kernel, dilation=d, padding=d * (kernel - 1) // 2) for d in dilations
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, 1, T] channels-last."""
        for conv in self.convs:
            x = conv_nhwc(F.leaky_relu(x, LRELU), conv).add_(x)  # type: ignore[arg-type]
        return x


class Generator(nn.Module):
    """HiFi-GAN: [B, inter, frames] -> [B, 1, frames * prod(upsample_rates)]"""

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        ch = cfg.upsample_initial
        self.conv_pre = nn.Conv1d(cfg.inter, ch, 7, padding=3)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernels)):
            out = ch // 2 ** (i + 1)
            self.ups.append(nn.ConvTranspose1d(ch // 2**i, out, k, u, padding=(k - u) // 2))
            for kr, d in zip(cfg.resblock_kernels, cfg.resblock_dilations):
                self.resblocks.append(ResBlock(out, kr, d))
        self.conv_post = nn.Conv1d(out, 1, 7, padding=3, bias=False)
        self.kernels = len(cfg.resblock_kernels)

    def to_nhwc(self) -> None:
        """Lay every convolution weight out channels-last (after the weights are loaded)."""
        for m in self.modules():
            if isinstance(m, nn.Conv1d | nn.ConvTranspose1d):
                nhwc_weight(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, C, T] -> [B, C, 1, T] channels-last for every convolution (see conv_nhwc)
        x = conv_nhwc(x[:, :, None].contiguous(memory_format=torch.channels_last), self.conv_pre)
        for i, up in enumerate(self.ups):
            x = conv_nhwc(F.leaky_relu(x, LRELU), up)  # type: ignore[arg-type]
            blocks = self.resblocks[i * self.kernels : (i + 1) * self.kernels]
            acc = blocks[0](x)
            for block in blocks[1:]:
                acc.add_(block(x))
            x = acc.div_(self.kernels)
        return torch.tanh(conv_nhwc(F.leaky_relu(x), self.conv_post))[:, :, 0]


@dataclass(frozen=True)
class Scales:
    noise: float = 0.667
    """Prior noise (0: deterministic)."""
    length: float = 1.0
    """Duration multiplier: > 1 speaks slower."""
    noise_w: float = 0.8
    """Duration noise (0: deterministic)."""


class Vits(nn.Module):
    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.enc_p = TextEncoder(cfg)
        self.dp = DurationPredictor(cfg.hidden)
        self.flow = Flow(cfg)
        self.dec = Generator(cfg)

    @property
    def hop(self) -> int:
        """Samples per frame."""
        return math.prod(self.cfg.upsample_rates)

    def latent(
        self, ids: torch.Tensor, scales: Scales, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """ids [1, T] -> the decoder's input [1, inter, frames] (one utterance)."""
        return self.flows(self.prior(ids, scales, generator))

    def flows(self, zp: torch.Tensor, frames: int | None = None) -> torch.Tensor:
        """Prior sample zp [1, inter, F] -> the decoder's input, all of it or its first
        ``frames`` (from zp's first ``frames + FLOW_CONTEXT``: equal up to rounding)."""
        if frames is not None:
            zp = zp[:, :, : frames + FLOW_CONTEXT]
        n = zp.shape[2]
        padded = bucketed(n)  # zero frames, masked: every layer sees its own zero padding
        mask = torch.ones(1, 1, padded)
        mask[:, :, n:] = 0
        z = self.flow.reverse(F.pad(zp, (0, padded - n)), mask)
        return z[:, :, : n if frames is None else frames]

    def prior(
        self, ids: torch.Tensor, scales: Scales, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """ids [1, T] -> the prior sample [1, inter, frames] that the flows map to the
        decoder's input: text encoder, durations, expansion to frames, noise."""
        mask = torch.ones(1, 1, ids.shape[1])
        x, m, logs = self.enc_p(ids, mask)
        noise_w = torch.randn(1, 2, ids.shape[1], generator=generator) * scales.noise_w
        w = torch.exp(self.dp(x, mask, noise_w)) * mask * scales.length
        frames = torch.ceil(w)[0, 0].long()  # [T] frames per phoneme
        m = m[0].repeat_interleave(frames, dim=1)[None]  # [1, inter, F]
        logs = logs[0].repeat_interleave(frames, dim=1)[None]
        return m + torch.randn(m.shape, generator=generator) * torch.exp(logs) * scales.noise

    def forward(
        self, ids: torch.Tensor, scales: Scales, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """ids [1, T] -> audio [samples] in [-1, 1] (one utterance)."""
        return self.dec(self.latent(ids, scales, generator))[0, 0]

    def decode_piece(self, z: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The waveform [samples] of ``piece`` of latent z [1, inter, F]."""
        audio = self.dec(z[:, :, piece.lo : piece.hi])[0, 0]
        return audio[(piece.start - piece.lo) * self.hop : (piece.end - piece.lo) * self.hop]

    def decode_chunks(
        self, z: torch.Tensor, first: int = 24, size: int = 512
    ) -> Iterator[torch.Tensor]:
        """The waveform of latent z [1, inter, F] in pieces (see ``pieces``)."""
        for piece in pieces(z.shape[2], first, size):
            yield self.decode_piece(z, piece)


FLOW_CONTEXT = 32
"""Prior frames that the flows see on either side (4 couplings of 4 kernel-5 convolutions:
+-32, measured)."""
CONTEXT = 12
"""Latent frames decoded on either side of a piece: an output sample at frame position p
depends on z frames p - 11.02 .. p + 9.96 (the generator's receptive field, measured)."""
SHAPE_BUCKET = 16
"""The flows' and the generator's inputs are a multiple of this many frames long (the
flows padded with masked zeros, a piece's window widened by more context: both exact).
oneDNN builds its convolution kernels per input length, ~50 per length and at most 1024
kept: every new sentence length used to cost a build (a 6-sentence text took 0.77 s the
first time, 0.50 s the next, on two Zen 5 cores) and a few texts overflowed the cache."""


def bucketed(frames: int) -> int:
    return -(-frames // SHAPE_BUCKET) * SHAPE_BUCKET


def widen(lo: int, hi: int, total: int) -> tuple[int, int]:
    """The window [lo, hi) of ``total`` frames grown to ``bucketed`` length (or to all of
    them): to the right first, then to the left."""
    want = min(bucketed(hi - lo), total)
    right = min(want - (hi - lo), total - hi)
    return lo - (want - (hi - lo) - right), hi + right


@dataclass(frozen=True)
class Piece:
    """Waveform frames [start, end), decoded from latent frames [lo, hi) and trimmed."""

    start: int
    end: int
    lo: int
    hi: int


def pieces(
    total: int, first: int = 0, size: int = 512, parts: int = 1, growth: int = 1
) -> list[Piece]:
    """Cut ``total`` latent frames into pieces that join into ``dec(z)`` up to rounding:
    ``first`` frames (0: none), then (``growth`` > 1) pieces ``growth`` times the one
    before while under ``size`` and while the rest holds at least two of them, then the
    rest in equal pieces of at most ``size`` frames, at least ``parts`` of them where each
    gets 64 frames or more (pieces for parallel workers). Each piece costs 2 x ``CONTEXT``
    frames more than its own (512: most sentences' rest is one piece, ~8% of a 3.8 s
    sentence's decoding). The ramp keeps a stream fed: each piece is decoded while the
    one before plays (a piece of n frames decodes in ~0.15 n frames' time on one core)."""
    cuts = [0]
    if 0 < first < total:
        cuts.append(first)
        step = first * growth
        while growth > 1 and step < size and cuts[-1] + 2 * step <= total:
            cuts.append(cuts[-1] + step)
            step *= growth
    rest = total - cuts[-1]
    n = max(-(-rest // size), min(parts, rest // 64), 1)
    cuts += [cuts[-1] + rest * i // n for i in range(1, n + 1)]
    return [
        Piece(a, b, *widen(max(0, a - CONTEXT), min(total, b + CONTEXT), total))
        for a, b in zip(cuts, cuts[1:])
    ]
