"""Which weight format each linear layer of a model gets: the ``quantization`` option.

``QUANTIZATIONS`` names what users choose; ``resolve_quantization`` turns ``auto`` into
one of them once the checkpoint and device are known; a ``QuantPlan`` then answers, per
module (by its name in the model), which ``LinearMethod`` stores its weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType as Q

from tokenmill import native
from tokenmill.errors import InvalidRequestError
from tokenmill.native.dense16 import fp32_native
from tokenmill.quant.gguf_blocks import DENSE_TYPES, INT4_EXACT_TYPES
from tokenmill.quant.methods import LinearMethod, method_for

QUANTIZATIONS: Mapping[str, str] = {
    "auto": "gguf on CPU for a GGUF checkpoint unless dtype is float32/float16; on CPU with "
    "dtype=auto a bf16/fp16 HF checkpoint keeps its 16-bit weights (KEPT_16BIT), and with "
    "a float32 one takes the native float32 kernel where it beats PyTorch's BLAS (NATIVE_FP32, "
    "TOKENMILL_FP32_GEMM); "
    "else none",
    "none": "dense weights in the model dtype (GGUF tensors are dequantized)",
    "gguf": "keep a GGUF's precision: 4-bit block types as int4 groups of 32 (exact), other "
    "quantized types as int8 (groups of 32; PyTorch's fallback: per row), float tensors dense",
    "int8": "every linear and the embedding table as int8",
    "int4": "every linear as int4 groups of 32 (round-to-nearest unless stored as 4-bit "
    "GGUF blocks), the embedding table as int8 per row",
}
ACTIVATION_PRECISIONS: Mapping[str, str] = {
    "high": "the default: the native int4/int8 kernels quantize each group of 32 activations "
    "into two int8 terms (~15 bits, finer than bfloat16; greedy tokens follow the float "
    "reference's)",
    "low": "one int8 term per group of 32 (llama.cpp's activation precision), or for bf16 "
    "weights one bfloat16 term (as a bfloat16 model computes): half the multiply-adds, so "
    "verify steps of speculative decoding, large batches and prefill run faster, at a "
    "measured quality cost (docs/architecture.md); CPU gguf/int8/int4 weights, and bf16 ones "
    "on a CPU with AVX512-BF16",
}
ACTIVATION_TERMS: Mapping[str, int] = {"high": 2, "low": 1}
KEPT_16BIT: Mapping[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16"}
"""What auto resolves to for an HF checkpoint stored in 16-bit floats, on CPU with the
native kernels and dtype=auto: the weights stay as stored (``quant/dense16.py``), float32
activations. Not a user choice: a resolved name only."""
NATIVE_FP32 = "fp32"
"""What auto resolves to for an HF checkpoint stored in float32 (dtype=auto), or in any
float dtype at dtype=float32, on CPU where ``native.dense16.fp32_native`` says the native
float32 kernel beats PyTorch's BLAS (``TOKENMILL_FP32_GEMM``; by default an AVX-512 CPU
not Intel's): float32 weights in that kernel's tiles. A resolved name only."""
FLOAT32_NAMES = ("float32", "float", "fp32")
"""The ``dtype`` names of float32 (``config.DTYPES``; not imported: config imports this)."""
FLOAT_FORMATS = ("bf16", "fp16", NATIVE_FP32)
"""Resolved names whose weights stay float (any shape packs: the tiles are padded)."""


def check_quantization(name: str) -> None:
    if name not in QUANTIZATIONS:
        raise InvalidRequestError(
            f"quantization={name!r} is not supported; use one of {', '.join(QUANTIZATIONS)}"
        )


def resolve_quantization(
    name: str, dtype: str, device: torch.device, fmt: str, stored: torch.dtype | None = None
) -> str:
    """``auto`` -> a concrete choice; checks that the choice fits the device and checkpoint.
    ``stored``: the float dtype every linear weight of the checkpoint is stored in, if one."""
    if name == "auto":
        fast = device.type == "cpu" and fmt == "gguf" and dtype in ("auto", "bfloat16", "bf16")
        if fast:
            return "gguf"
        cpu = device.type == "cpu" and native.available()
        if cpu and dtype == "auto" and stored in KEPT_16BIT:
            return KEPT_16BIT[stored]
        # float32 weights: stored so (dtype auto), or any float folder at dtype=float32
        float32 = stored == torch.float32 if dtype == "auto" else dtype in FLOAT32_NAMES
        wins = fp32_native()  # see NATIVE_FP32
        if cpu and fmt == "hf" and stored is not None and float32 and wins:
            return NATIVE_FP32
        return "none"
    if name != "none" and device.type != "cpu":
        raise InvalidRequestError(
            f"quantization={name!r} uses CPU kernels; on {device.type} use quantization='none'"
        )
    if name == "gguf" and fmt != "gguf":
        raise InvalidRequestError(
            "quantization='gguf' keeps a GGUF file's own formats and this checkpoint is not a "
            "GGUF file; use quantization='int8' (or 'int4') to quantize it at load"
        )
    return name


@dataclass(frozen=True)
class QuantPlan:
    """The weight format of every linear layer and the embedding table of one model."""

    quantization: str
    """A resolved ``QUANTIZATIONS`` name other than auto and none."""
    stored_types: Mapping[str, frozenset[Q]] = field(default_factory=dict)
    """Module name -> the GGUF types its checkpoint tensors are stored in (GGUF only)."""
    activation_terms: int = 2
    """int8 terms per activation of the int4/int8 layers (``ACTIVATION_TERMS``)."""

    def linear_method(
        self, prefix: str, out_sizes: Sequence[int], in_features: int
    ) -> LinearMethod:
        """Method of the linear named ``prefix`` with output shards ``out_sizes``."""
        name = self._choice(prefix)
        if name in FLOAT_FORMATS:  # any shape: the tiles are padded
            return method_for(name, self.activation_terms)
        if name == "int4" and not _fits(name, out_sizes, in_features):
            name = "int8"
        if name == "int8" and not _fits(name, out_sizes, in_features):
            name = "dense"  # shards off the packed layout's row blocks, or partial groups
        return method_for(name, self.activation_terms)

    def embedding_method(self, prefix: str) -> LinearMethod:
        """Tables stay 8-bit at least: a 4-bit output head costs too much quality."""
        choice = self._choice(prefix)
        if choice == "dense":
            return method_for(choice)
        return method_for(choice if choice in FLOAT_FORMATS else "int8", self.activation_terms)

    def _choice(self, prefix: str) -> str:
        if self.quantization != "gguf":
            return self.quantization
        types = self.stored_types.get(prefix, frozenset())
        if not types or types <= DENSE_TYPES:
            return "dense"
        return "int4" if types <= INT4_EXACT_TYPES else "int8"


def _fits(name: str, out_sizes: Sequence[int], in_features: int) -> bool:
    """Whole groups of 32 inputs, and every shard on the layout's blocks of output rows
    (native tiles of 16; PyTorch's int4 packs rows by 64, its int8 row by row)."""
    if native.available():
        align = tail = native.TILE
    else:
        align, tail = (64, 16) if name == "int4" else (1, 1)
    return (
        in_features % 32 == 0
        and sum(out_sizes) % tail == 0
        and all(n % align == 0 for n in out_sizes[:-1])
    )


def stored_float_dtype(ckpt) -> torch.dtype | None:
    """The dtype all 2-D weights of a safetensors checkpoint are stored in (read from the
    file headers, no tensor data), or None when they differ or the checkpoint is no HF folder."""
    from safetensors import safe_open

    found: set[str] = set()
    for file in getattr(ckpt.source, "files", ()):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                part = f.get_slice(name)
                if name.endswith(".weight") and len(part.get_shape()) == 2:
                    found.add(part.get_dtype())
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    return dtypes.get(found.pop()) if len(found) == 1 else None


def auto_dtype() -> torch.dtype:
    """What dtype=auto means with quantized weights: float32 where the native kernel runs
    (it quantizes activations finer than bfloat16 anyway, so float32 keeps the dequantized
    reference's numbers at no cost), bfloat16 for PyTorch's kernels (their fast paths)."""
    return torch.float32 if native.available() else torch.bfloat16


def linear_method(
    plan: QuantPlan | None, prefix: str, out_sizes: Sequence[int], in_features: int
) -> LinearMethod | None:
    """The plan's method for a linear layer; None (dense) without a plan."""
    return None if plan is None else plan.linear_method(prefix, out_sizes, in_features)


def build_plan(
    quantization: str, hf_types: Mapping[str, Q], activation_precision: str = "high"
) -> QuantPlan | None:
    """The plan of a resolved quantization (None for none); ``hf_types`` maps each HF
    tensor name of a GGUF checkpoint to its stored type ({} for other checkpoints)."""
    from tokenmill.models.weights import module_name

    check_activation_precision(activation_precision, quantization)
    if quantization == "none":
        return None
    stored: dict[str, set[Q]] = {}
    for hf_name, qtype in hf_types.items():
        stored.setdefault(module_name(hf_name), set()).add(qtype)
    terms = ACTIVATION_TERMS[activation_precision]
    return QuantPlan(quantization, {k: frozenset(v) for k, v in stored.items()}, terms)


class ActivationPrecisionError(InvalidRequestError):
    """activation_precision='low' on weights whose kernels it would not change."""


def check_activation_precision(precision: str, quantization: str | None = None) -> None:
    """A known name; with a resolved ``quantization``, one whose kernels it changes ("low"
    needs the native int4/int8 kernels: anything else would silently ignore it)."""
    if precision not in ACTIVATION_PRECISIONS:
        raise InvalidRequestError(
            f"activation_precision={precision!r} is unknown; use one of "
            f"{', '.join(ACTIVATION_PRECISIONS)}"
        )
    if precision == "low" and quantization is not None:
        from tokenmill.native.dense16 import has_avx512_bf16

        bf16 = quantization == "bf16" and has_avx512_bf16()
        if not (quantization in ("gguf", "int8", "int4") or bf16) or not native.available():
            where = "here" if native.available() else "without the native CPU kernels"
            raise ActivationPrecisionError(
                "activation_precision='low' changes the native int4/int8 kernels (and the "
                "bf16 one on an AVX512-BF16 CPU) only, and this model's weights resolve to "
                f"quantization={quantization!r} {where}; use a GGUF checkpoint or "
                "quantization='int8'/'int4' on CPU, or activation_precision='high'"
            )
