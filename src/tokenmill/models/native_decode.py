"""Decode steps of a quantized pre-norm decoder as one native call per layer.

At one token per sequence the arithmetic of a layer is small and Python-level operations
(~40 per layer) cost more than the matmuls. When every layer is a plain pre-norm layer
(Llama, Mistral, Qwen2: no q/k norms, no sandwich norms, no soft-capping) with weights the
native layer takes (affine groups, 16-bit floats: ``LinearMethod.native_weight``) and the
model runs the native attention backend (float32, native kernels; chosen
once at load, ``layers/ops.py``), ``NativeDecode.build`` gives an object that runs an
all-decode step: the same float32 computation as the per-op native path (the native norm
kernels, ``attention/native_backend.py``), one ``decode_layers`` call for all layers (one
``decode_layer`` call each where a speculative head taps the stream between them). The
step's scratch buffers are kept across steps (a decode step is ~10 ms at one row: the
Python around the layers is worth trimming). The runner owns it as a fast path
(``worker/fast_path.py``).
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill import native
from tokenmill.attention import StepContext
from tokenmill.host_memory import oversized
from tokenmill.layers.linear import Linear
from tokenmill.layers.rotary import RopeTables
from tokenmill.models.base import CausalLM
from tokenmill.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderModel

_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}


def supports(model: DecoderModel) -> bool:
    """Whether every layer of ``model`` can run as one native call (checked once, at build)."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (
            type(layer) is not DecoderLayer
            or attn.backend.name != "native"
            or attn.q_norm is not None
            or mlp.act.name not in _ACTIVATIONS
            or not all(p.method.native_weight(p) is not None for p in projections)
        ):
            return False
    return True


class NativeDecode:
    """Runs the layers of a ``supports``-ed model for all-decode float32 steps."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self._descs: tuple[tuple[int, ...], ctypes.Array] | None = None
        """(KV cache addresses, their ``LayerDesc`` array)"""
        self._keep: list[torch.Tensor] = []  # tensors the descriptors point into
        self._scratch: dict[str, torch.Tensor] = {}  # the layers' buffers, kept across steps
        self._addresses: dict[str, int] = {}  # their data pointers, remade when one grows
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        hidden, inter = attn.spec.hidden_size, mlp.down_proj.in_features
        widest = max(hidden, inter)
        self._per_row = {  # elements per row (the scores: per row and head, times slots)
            "normed": hidden, "qkv": attn.qkv_proj.out_features, "attn": attn.q_size,
            "gate_up": 2 * inter, "act": inter, "scores": attn.spec.num_heads,
            "qx": 2 * widest, "dx": widest // 32, "sx": widest // 32,
        }  # fmt: skip

    @classmethod
    def build(cls, model: CausalLM) -> NativeDecode | None:
        """The whole-layer decode of ``model``, or None when it can not run that way."""
        if not isinstance(model, DecoderForCausalLM) or not supports(model.model):
            return None
        return cls(model.model)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """One new token per sequence: input_ids, positions [B] -> final hidden [B, hidden]."""
        hidden = self.model.embed(input_ids, ctx).contiguous()
        rope = self.model.rope_tables(positions)
        hidden, residual = self._layers(
            hidden, rope[self.model.layers[0].self_attn.rotary_emb], ctx
        )
        return self.model.norm.forward_residual(hidden, residual)[0]

    def _layers(
        self, hidden: torch.Tensor, tables: RopeTables, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, hidden] float32 embeddings -> (last layer output, residual stream)."""
        meta = ctx.attn
        batch = hidden.shape[0]
        extra = meta.extra_slots  # a draft tree's ancestors past each row's context
        extras = 0 if extra is None else extra.shape[1]
        residual = torch.empty_like(hidden)
        max_len = max(meta.seq_lens)
        scratch = self._buffers(batch, max_len + extras)
        step = native.StepArgs(
            tokens=batch, table_width=meta.block_tables.stride(0), max_len=max_len,
            first_layer=1, hidden=hidden.data_ptr(), residual=residual.data_ptr(),
            cos=tables.cos.data_ptr(), sin=tables.sin.data_ptr(),
            slots=meta.slot_mapping.data_ptr(), block_tables=meta.block_tables.data_ptr(),
            seq_lens=meta.seq_lens_tensor.data_ptr(), **scratch,
            extra_slots=None if extra is None else extra.data_ptr(), max_extra=extras,
        )  # fmt: skip
        descs = self._layer_descs(ctx.kv_caches)
        tap = self.model.aux_tap
        if tap is None:
            native.decode_layers(descs, step)
            return hidden, residual
        for i, desc in enumerate(descs):
            # the stream in front of layer i (after layer 0 has run)
            tap.capture(i, hidden, None if step.first_layer else residual)
            native.decode_layer(desc, step)
            step.first_layer = 0
        return hidden, residual

    def _buffers(self, batch: int, slots: int) -> dict[str, int]:
        """Addresses of the layers' scratch for ``batch`` rows whose attention scores take
        ``slots`` per row and head; each buffer grown (to a power of two) and kept, and given
        back once steps need a small part of a large one (after a long context finished)."""
        for name, per_row in self._per_row.items():
            size = _pow2(batch * per_row * (slots if name == "scores" else 1), 4096)
            held = self._scratch.get(name)
            if held is None or held.numel() < size or oversized(held, size):
                dtype = torch.int8 if name == "qx" else torch.float32
                self._scratch[name] = torch.empty(size, dtype=dtype)
                self._addresses = {n: t.data_ptr() for n, t in self._scratch.items()}
        return self._addresses

    def _layer_descs(self, kv_caches) -> ctypes.Array:
        key = tuple(c.data_ptr() for c in kv_caches)
        if self._descs is None or self._descs[0] != key:
            self._keep = []
            descs = [
                self._describe(layer, kv_caches[i]) for i, layer in enumerate(self.model.layers)
            ]
            self._descs = (key, (native.LayerDesc * len(descs))(*descs))
        return self._descs[1]

    def _describe(self, layer: DecoderLayer, kv_cache: torch.Tensor) -> native.LayerDesc:
        attn, mlp, spec = layer.self_attn, layer.mlp, layer.self_attn.spec
        norms = (
            layer.input_layernorm.scaled_weight(),
            layer.post_attention_layernorm.scaled_weight(),
        )
        self._keep.extend(norms)
        _, blocks, block_size = kv_cache.shape[:3]
        return native.LayerDesc(
            qkv=self._proj(attn.qkv_proj), o=self._proj(attn.o_proj),
            gate_up=self._proj(mlp.gate_up_proj), down=self._proj(mlp.down_proj),
            input_norm=norms[0].data_ptr(), post_norm=norms[1].data_ptr(),
            eps_sum=layer.input_layernorm.eps_sum, scale=spec.scale,
            hidden=spec.hidden_size, q_heads=spec.num_heads, kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, intermediate=mlp.down_proj.in_features,
            window=spec.sliding_window or 0, activation=_ACTIVATIONS[mlp.act.name],
            kv_cache=kv_cache.data_ptr(), cache_slots=blocks * block_size, block_size=block_size,
        )  # fmt: skip

    def _proj(self, linear: Linear) -> native.Proj:
        bias = None
        if linear.bias is not None:
            bias = linear.bias.detach().float().contiguous()
            self._keep.append(bias)
        tiles, code = linear.method.native_weight(linear)
        return native.Proj(
            tiles=tiles, bias=bias.data_ptr() if bias is not None else None,
            bits=code, out=linear.out_features, in_=linear.in_features,
            terms=linear.method.activation_terms,
        )  # fmt: skip


def _pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()
