"""Method -> head loader: the head of ``speculative_config`` beside its target."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.models.decoder import DecoderForCausalLM

if TYPE_CHECKING:
    from tokenmill.spec_decode.config import SpeculativeConfig
    from tokenmill.spec_decode.heads import SpecHead
    from tokenmill.spec_decode.registry import TargetParts


def _eagle3(spec: SpeculativeConfig, target: TargetParts, max_positions: int) -> SpecHead:
    from tokenmill.spec_decode.heads.eagle3 import Eagle3Head, read_head_folder

    assert spec.model is not None
    config, weights = read_head_folder(spec.model)
    model = target.loaded.model
    assert isinstance(model, DecoderForCausalLM)
    with torch.device(target.loaded.device):
        head = Eagle3Head(config, model, target.loaded.dtype, max_positions)
    head.load(weights)
    return head


def _mtp(spec: SpeculativeConfig, target: TargetParts, max_positions: int) -> SpecHead:
    from tokenmill.loader import load_checkpoint
    from tokenmill.spec_decode.heads.mtp import MTPHead, mtp_layer_count

    checkpoint = target.loaded.checkpoint
    if spec.model is not None:  # the MTP layers in another copy of the checkpoint
        checkpoint = load_checkpoint(spec.model)
    if mtp_layer_count(checkpoint.hf_config) < 1:
        raise InvalidRequestError(
            f"speculative_config: method 'mtp' needs a checkpoint with multi-token-prediction "
            f"layers (num_nextn_predict_layers >= 1); {checkpoint.path} has none: use eagle3, "
            "draft_model, ngram or suffix"
        )
    model = target.loaded.model
    assert isinstance(model, DecoderForCausalLM)
    dtype = target.loaded.dtype
    with torch.device(target.loaded.device):
        head = MTPHead(checkpoint.hf_config, model, dtype, max_positions)
    head.load(checkpoint.weights(dtype))
    return head


HEADS: dict[str, Callable[[SpeculativeConfig, TargetParts, int], SpecHead]] = {
    "eagle3": _eagle3,
    "mtp": _mtp,
}


def load_head(spec: SpeculativeConfig, target: TargetParts) -> SpecHead:
    model = target.loaded.model
    if not isinstance(model, DecoderForCausalLM):
        raise InvalidRequestError(
            f"speculative_config: method {spec.method!r} reads the target's hidden states, "
            f"which {type(model).__name__} does not expose; use ngram, suffix or draft_model"
        )
    max_positions = target.loaded.max_model_len + spec.num_speculative_tokens + 1
    return HEADS[spec.method](spec, target, max_positions)
