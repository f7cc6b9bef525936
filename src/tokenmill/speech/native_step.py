"""Whisper's decode step in native code: one C call per decoder layer (kernels/whisper_layer.c).

A decode step (one new token per row) of tiny.en is ~30 PyTorch operations per layer on
rows of 384 floats: each op's dispatch and OpenMP barrier cost about what its arithmetic
does, so the step ran at ~1.8x the time its memory traffic needs. ``NativeDecoder`` holds
each layer's weights in the native float32 kernel's tiles (q/k/v fused: one product
instead of three) and runs the layer in one call; embeddings, the final norm and the
output head stay in PyTorch. It applies where ``pack_native`` packed the model (the
native float32 kernel is the default here) and the cache is float32.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tokenmill import native
from tokenmill.native import dense16
from tokenmill.quant.dense16 import NativeLinear

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class WhisperLayer(ctypes.Structure):
    """A layer's fixed part (see the C struct): tiles, biases, norms, its cache slices."""

    _fields_ = [
        ("qkv", _ptr), ("o", _ptr), ("cross_q", _ptr), ("cross_o", _ptr), ("fc1", _ptr),
        ("fc2", _ptr), ("qkv_b", _ptr), ("o_b", _ptr), ("cross_q_b", _ptr),
        ("cross_o_b", _ptr), ("fc1_b", _ptr), ("fc2_b", _ptr), ("ln1_w", _ptr), ("ln1_b", _ptr),
        ("ln2_w", _ptr), ("ln2_b", _ptr), ("ln3_w", _ptr), ("ln3_b", _ptr), ("self_k", _ptr),
        ("self_v", _ptr), ("cross_k", _ptr), ("cross_v", _ptr), ("kernel", _i64),
        ("hidden", _i64), ("heads", _i64), ("head_dim", _i64), ("ffn", _i64),
        ("max_len", _i64), ("src_len", _i64), ("eps", _f32),
    ]  # fmt: skip


class WhisperStep(ctypes.Structure):
    """One step's rows, positions, residual stream and scratch (see the C struct)."""

    _fields_ = [
        ("rows", _i64), ("pos", _ptr), ("x", _ptr), ("h", _ptr), ("qkv", _ptr),
        ("attn", _ptr), ("ff", _ptr), ("scores", _ptr),
    ]  # fmt: skip


@dataclass
class _LayerWeights:
    """One layer's tensors the C side reads (kept alive here)."""

    qkv: NativeLinear
    """q, k and v of the self-attention as one [3 D, D] product; k's bias is zeros."""
    o: NativeLinear
    cross_q: NativeLinear
    cross_o: NativeLinear
    fc1: NativeLinear
    fc2: NativeLinear
    norms: tuple[torch.nn.LayerNorm, torch.nn.LayerNorm, torch.nn.LayerNorm]


def _bias(layer: NativeLinear) -> torch.Tensor:
    assert layer.bias is not None
    return layer.bias


def _fused_qkv(q: NativeLinear, k: NativeLinear, v: NativeLinear) -> NativeLinear:
    d = q.in_features
    rows = torch.arange(d)
    weight = torch.cat([dense16.read_rows(m.wtiles, rows, d) for m in (q, k, v)])
    bias = torch.cat([_bias(q), torch.zeros(d), _bias(v)])
    return NativeLinear(weight, bias)


class NativeDecoder:
    """The decoder layers of a packed float32 Whisper, stepped natively.

    ``build`` returns None where it does not apply (layers not packed, norms' eps differ).
    ``step`` runs the layers for rows 0..B-1 of a cache; descriptors are made once per
    cache (they hold its addresses). The fused q/k/v tiles are a second copy of those three
    weights: prompts (T > 1) still run the PyTorch layers on the separate ones.
    """

    def __init__(self, layers: list[_LayerWeights], heads: int, eps: float) -> None:
        self.layers = layers
        self.heads = heads
        self.eps = eps
        self._cache: object | None = None
        """The cache ``_descs`` point into (one engine, one cache: the latest is kept)."""
        self._descs: list[WhisperLayer] = []

    @staticmethod
    def build(decoder: torch.nn.Module, heads: int) -> NativeDecoder | None:
        layers: list[_LayerWeights] = []
        eps: set[float] = set()
        for layer in decoder.layers:
            self_attn, cross = layer.self_attn, layer.encoder_attn
            mods = (self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.out_proj,
                    cross.q_proj, cross.out_proj, layer.fc1, layer.fc2)  # fmt: skip
            if not all(isinstance(m, NativeLinear) for m in mods):
                return None
            norms = (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm,
                     layer.final_layer_norm)  # fmt: skip
            eps |= {n.eps for n in norms}
            layers.append(
                _LayerWeights(_fused_qkv(*mods[:3]), *mods[3:], norms)  # type: ignore[arg-type]
            )
        if len(eps) != 1 or not native.available():
            return None
        return NativeDecoder(layers, heads, eps.pop())

    def _layer_descs(self, cache: object) -> list[WhisperLayer]:
        """The layers' descriptors pointing into ``cache`` (a ``DecoderCache``)."""
        if cache is self._cache:
            return self._descs
        self_k, self_v = cache.self_k, cache.self_v  # type: ignore[attr-defined]
        cross_k, cross_v = cache.cross_k, cache.cross_v  # type: ignore[attr-defined]
        descs = []
        for i, w in enumerate(self.layers):
            desc = WhisperLayer(
                w.qkv.wtiles.data_ptr(), w.o.wtiles.data_ptr(), w.cross_q.wtiles.data_ptr(),
                w.cross_o.wtiles.data_ptr(), w.fc1.wtiles.data_ptr(), w.fc2.wtiles.data_ptr(),
                *(_bias(m).data_ptr() for m in (w.qkv, w.o, w.cross_q, w.cross_o, w.fc1, w.fc2)),
                *(t.data_ptr() for n in w.norms for t in (n.weight, n.bias)),
                self_k[i].data_ptr(), self_v[i].data_ptr(),
                cross_k[i].data_ptr(), cross_v[i].data_ptr(),
                w.qkv.kernel_id, w.o.in_features, self.heads, w.o.in_features // self.heads,
                w.fc1.out_features, self_k.shape[3], cross_k.shape[3], self.eps,
            )  # fmt: skip
            descs.append(desc)
        self._cache, self._descs = cache, descs
        return descs

    def step(self, x: torch.Tensor, pos: torch.Tensor, cache: object) -> torch.Tensor:
        """x [B, D] float32 (embeddings) for cache rows 0..B-1 writing positions pos [B]
        -> the last layer's output [B, D] (x is updated in place and returned)."""
        descs = self._layer_descs(cache)
        b, d = x.shape
        ffn = self.layers[0].fc1.out_features
        width = max(descs[0].max_len, descs[0].src_len)
        pos = pos.to(torch.int64).contiguous()
        h, attn = torch.empty(b, d), torch.empty(b, d)
        qkv, ff = torch.empty(b, 3 * d), torch.empty(b, ffn)
        scores = torch.empty(b * self.heads, width)
        step = WhisperStep(
            b, pos.data_ptr(), x.data_ptr(), h.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
            ff.data_ptr(), scores.data_ptr(),
        )  # fmt: skip
        address = ctypes.addressof(step)
        for desc in descs:
            native.whisper_decode_layer(ctypes.addressof(desc), address)
        return x
