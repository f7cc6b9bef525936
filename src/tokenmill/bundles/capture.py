"""A built model's state as named tensors, and the same state assigned into a fresh model.

The state of a tokenmill model is its parameters and buffers, persistent or not: dense
weights, the packed tiles of the quantized and 16-bit formats (``qtiles``, ``wtiles``,
``qweight``/``scales``/``scale_zeros``), biases, norms, and the rotary cos/sin tables.
Anything derived from addresses (``NativeDecode``'s layer descriptors, ``RMSNorm``'s
scaled weight) is recomputed from the tensors when first used, keyed by ``data_ptr``, so
it follows the assigned tensors. A module attribute that is a tensor but neither a
parameter nor a buffer can not be captured: ``check_capturable`` refuses to write such a
model's bundle, so its loads stay cold rather than run with a placeholder.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from tokenmill.errors import ModelLoadError


def model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor, alias -> name): every parameter and buffer once; a tensor that two
    modules share (a tied head) is stored under its first name and aliased by the others."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, t in _slots(model):
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            tensors[name] = t.detach()
    return tensors, aliases


def assign_tensors(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]
) -> None:
    """Replace every parameter and buffer of ``model`` (built unfilled) by the
    tensor of the same name; shared tensors stay shared. Raises ModelLoadError when the
    names or shapes do not match the model."""
    wanted = dict(_slots(model))
    known = set(tensors) | set(aliases)
    if set(wanted) != known:
        missing, extra = sorted(set(wanted) - known), sorted(known - set(wanted))
        raise ModelLoadError(
            f"bundle does not fit the model: missing {missing[:5]}, extra {extra[:5]}"
        )
    made: dict[str, torch.Tensor] = {}
    for name, old in wanted.items():
        src = tensors[aliases.get(name, name)]
        if src.shape != old.shape or src.dtype != old.dtype:
            raise ModelLoadError(
                f"bundle tensor {name!r} is {src.dtype}{tuple(src.shape)}, the model wants "
                f"{old.dtype}{tuple(old.shape)}"
            )
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        root = aliases.get(name, name)
        if root not in made:
            made[root] = (
                nn.Parameter(src, requires_grad=False) if attr in owner._parameters else src
            )
        if attr in owner._parameters:
            owner._parameters[attr] = made[root]  # type: ignore[assignment]
        else:
            owner._buffers[attr] = made[root]


def check_capturable(model: nn.Module) -> None:
    """Raise ModelLoadError when a module holds a tensor outside its parameters and buffers:
    state a bundle would not restore (the bundle is then not written)."""
    for mod_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                raise ModelLoadError(
                    f"{mod_name or 'model'}.{attr} is a tensor outside the parameters and "
                    "buffers; a bundle can not restore it"
                )


def _slots(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(full name, tensor) of every parameter and buffer slot, shared ones under each name."""
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for kind in (module._parameters, module._buffers):
            for attr, t in kind.items():
                if t is not None:
                    yield (f"{mod_name}.{attr}" if mod_name else attr), t
