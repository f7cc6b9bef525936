"""bfloat16 / float16 weights kept in their 16-bit format, float32 activations (native kernels).

A Hugging Face checkpoint stored in bfloat16 (or float16) loads as it is: the weights stay
16-bit in the native kernel's tiles (``native/dense16.py``), which widen them on the fly
and accumulate in float32, so a decode step reads half the bytes of float32 weights and
computes what float32 weights would (the AVX512-BF16 kernel keeps the activations to
16 significant bits, see ``kernels/dense16_gemm.c``). The kernel is chosen once, when the
method is built (``dense16_method``), from the CPU's features.
"""

from __future__ import annotations

import functools
import logging

import torch

from tokenmill import native
from tokenmill.native import dense16
from tokenmill.quant.base import LinearMethod, check_rows, row_chunks, to_float

logger = logging.getLogger(__name__)

FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Weight format name (a resolved ``quantization``) -> the dtype it keeps (fp32: the native
float32 kernel, chosen where it beats PyTorch's BLAS, see ``dense16.fp32_native``)."""


class Dense16Method(LinearMethod):
    """Weights [out, in] in 16-bit tiles of 16 rows (``wtiles``); one ``dense16`` kernel."""

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        self.kernel_id, self.dtype = dense16.KERNELS[kernel]
        self.activation_terms = 1 if kernel == dense16.ONE_TERM_KERNEL else 2
        self.name = next(k for k, v in FORMATS.items() if v == self.dtype)
        self.native_code = dense16.NATIVE_CODE_BASE + self.kernel_id

    def create_weights(self, layer, out_features, in_features, dtype):
        tiles = dense16.empty_tiles(out_features, in_features, self.dtype)
        layer.register_buffer("wtiles", tiles)
        layer.dense16_out = out_features

    def load_rows(self, layer, start, src):
        cols = _in_features(layer)
        check_rows(layer, start, src, layer.dense16_out, cols)
        for i, part in row_chunks(src):
            dense16.write_rows(
                layer.wtiles, start + i, part if isinstance(part, torch.Tensor) else to_float(part)
            )

    def apply(self, layer, x, bias):
        n = layer.dense16_out
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            y = dense16.gemm(x, layer.wtiles, self.kernel_id, n)  # the decode hot path
        else:
            flat = x.reshape(-1, x.shape[-1]).float().contiguous()
            y = dense16.gemm(flat, layer.wtiles, self.kernel_id, n)
            y = y.view(*x.shape[:-1], n).to(x.dtype)
        return y if bias is None else y + bias

    def embed(self, layer, ids, dtype):
        return dense16.read_rows(layer.wtiles, ids, _in_features(layer)).to(dtype)

    def weight_bytes(self, layer):
        return layer.dense16_out * _in_features(layer) * self.dtype.itemsize

    def storage(self, layer):
        return [layer.wtiles]

    def native_weight(self, layer) -> tuple[int, int]:
        """(address, ``Proj.bits`` code) for ``decoder_layer.c``."""
        return layer.wtiles.data_ptr(), self.native_code


def _in_features(layer) -> int:
    return layer.in_features if hasattr(layer, "in_features") else layer.embedding_dim


def dense16_method(name: str, activation_terms: int = 2) -> Dense16Method:
    """The method of format ``name`` (bf16 / fp16 / fp32) with the best kernel of the native
    library in use (chosen once per ISA level, ``native.active_isa()``); one activation term
    (``activation_precision="low"``): bf16 only, see ``dense16.best_kernel``."""
    return _method(name, native.active_isa(), activation_terms)


@functools.cache
def _method(name: str, isa: str | None, activation_terms: int) -> Dense16Method:
    kernel = dense16.best_kernel(FORMATS[name], activation_terms)
    logger.info("%s weights: native kernel %s", name, kernel)
    return Dense16Method(kernel)


def move_float32_to_native(model: torch.nn.Module, planned: bool, fill: bool = True) -> int:
    """After a float32 load: the dense layers (``planned``: a plan made its own) and the
    towers' ``nn.Linear`` layers into the native float32 kernel's tiles; the layers moved.
    ``fill=False`` (a bundle's unfilled model, ``bundles/store.py``) gives the same modules
    with empty tiles, for the mapped tensors to replace."""
    moved = 0 if planned else repack_dense_float32(model, fill)
    return moved + swap_float32_linears(model, fill)


def moved_to_native(model: torch.nn.Module) -> bool:
    """Whether ``move_float32_to_native`` changed ``model`` (a bundle records it)."""
    return any(
        isinstance(m, NativeLinear)
        or (
            isinstance(method := getattr(m, "method", None), Dense16Method)
            and method.name == "fp32"
        )
        for m in model.modules()
    )


def repack_dense_float32(model: torch.nn.Module, fill: bool = True) -> int:
    """Move every dense float32 CPU weight of ``model``'s linears and tables (the layers
    whose method is ``methods.DenseMethod``, named "dense") into the native float32 kernel's
    tiles, once the weights have loaded; each dense weight is freed as its tiles fill. For
    the models that build no quantization plan (the hybrids, ``CausalLM.takes_quant_plan``).
    ``fill=False``: empty tiles. Returns the layers moved."""
    method = dense16_method("fp32")
    moved = 0
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        dense = getattr(getattr(layer, "method", None), "name", None) == "dense"
        if not dense or weight is None:
            continue
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        w = weight.detach()
        del layer.weight
        method.create_weights(layer, w.shape[0], w.shape[1], torch.float32)
        if fill:
            method.load_rows(layer, 0, w)
        layer.method = method
        moved += 1
    return moved


class NativeLinear(torch.nn.Module):
    """A float32 weight [out, in] (an ``nn.Linear``'s, ``swap_float32_linears``, or a tied
    output table's) in the native float32 kernel's tiles; y = x W^T + b for x [..., in]."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, fill: bool = True
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        tiles = dense16.empty_tiles(self.out_features, self.in_features, torch.float32)
        if fill:  # else empty tiles of the right shape (a bundle's unfilled model)
            dense16.write_rows(tiles, 0, weight.detach())
        self.register_buffer("wtiles", tiles)
        self.bias = bias
        self.kernel_id = dense16.KERNELS[dense16.FP32_KERNEL][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        y = dense16.gemm(flat, self.wtiles, self.kernel_id, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


def swap_float32_linears(model: torch.nn.Module, fill: bool = True) -> int:
    """Replace every plain float32 CPU ``nn.Linear`` in ``model`` (the vision and audio
    towers' layers; subclasses, whose owners may read ``.weight``, stay) by a
    ``NativeLinear`` (``fill=False``: empty tiles); the number replaced."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            if child.weight.dtype != torch.float32 or child.weight.device.type != "cpu":
                continue
            setattr(parent, name, NativeLinear(child.weight, child.bias, fill))
            swapped += 1
    return swapped
