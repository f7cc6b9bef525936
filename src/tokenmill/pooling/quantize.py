"""``quantization`` for pooling models: which choices an encoder takes, and the int8 swap.

Encoders run every token of a batch through each linear at once, so their int8 path is
the many-row kernel (``quant/rows.py``), not the per-layer ``QuantPlan`` of generation:
the model is loaded dense in float32, then each layer's linears named in its
``INT8_TERMS`` are replaced by 8-bit affine-group copies and the float weights freed.
``INT8_TERMS`` also says each linear's activation precision (1 or 2 int8 terms), chosen
by measured cosine against float32 (see ``models/bert.py``); ``INT8_PRECISE_TERMS`` the
precision for the rows whose output does not average the rounding over many tokens
(the runner lists them: ``PackedBatch.precise_rows``).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import native
from tokenmill.errors import InvalidRequestError

POOLING_QUANTIZATIONS = ("auto", "none", "int8")


def resolve_pooling_quantization(
    name: str, dtype: str, device: torch.device, model_cls: type, causal: bool
) -> str:
    """-> ``none`` or ``int8``; a clear error for any combination this path can not run."""
    if name in ("auto", "none"):
        return "none"
    if name not in POOLING_QUANTIZATIONS:
        raise InvalidRequestError(
            f"quantization={name!r} is not supported for pooling models (embed / score / "
            "classify); use quantization='int8' or 'none'"
        )
    layer = getattr(model_cls, "int8_layer", None)
    if causal or layer is None:
        raise InvalidRequestError(
            f"quantization='int8' is not supported for {model_cls.__name__} as a pooling "
            "model; it is for BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa); use "
            "quantization='none'"
        )
    if device.type != "cpu":
        raise InvalidRequestError(
            f"quantization='int8' for pooling models runs CPU kernels; on {device.type} use "
            "quantization='none' (or dtype='bfloat16')"
        )
    if dtype not in ("auto", "float32", "bfloat16"):
        raise InvalidRequestError(
            f"quantization='int8' takes float32 or bfloat16 activations; dtype={dtype!r} does "
            "not combine with it: use dtype='auto' (float32), 'float32' or 'bfloat16'"
        )
    if not native.available():
        raise InvalidRequestError(
            "quantization='int8' for pooling models needs the native CPU kernels (x86-64 with "
            "AVX2+FMA+F16C and a C compiler); they are unavailable here: use "
            "quantization='none'"
        )
    return "int8"


def quantize_int8(model: nn.Module) -> int:
    """Replace, in every ``model.int8_layer`` module, the linears its ``INT8_TERMS`` names
    by ``RowsInt8Linear``, and set ``model.int8_averaged_from`` (the runner reads it);
    returns how many were replaced."""
    from tokenmill.quant.rows import RowsInt8Linear

    layer_cls: type[nn.Module] = getattr(model, "int8_layer")  # noqa: B009 (a class attribute)
    terms_of: dict[str, int] = getattr(layer_cls, "INT8_TERMS")  # noqa: B009
    precise_of: dict[str, int] = getattr(layer_cls, "INT8_PRECISE_TERMS", terms_of)
    count = 0
    for module in model.modules():
        if not isinstance(module, layer_cls):
            continue
        for name, terms in terms_of.items():
            linear = getattr(module, name)
            setattr(module, name, RowsInt8Linear.of(linear, terms, precise_of.get(name)))
            count += 1
    model.int8_averaged_from = getattr(layer_cls, "INT8_AVERAGED_FROM", None)
    return count
