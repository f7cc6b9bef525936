"""Xiaomi MiMo: Qwen2's decoder; its checkpoint also carries multi-token-prediction layers
(``model.mtp_layers.N.*``, ``num_nextn_predict_layers``), which only speculative decoding
reads (``speculative_config={"method": "mtp"}``, ``spec_decode/heads/mtp.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tokenmill.models.qwen2 import Qwen2ForCausalLM

MTP_PREFIX = "model.mtp_layers."


class MiMoForCausalLM(Qwen2ForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, t) for n, t in weights if not n.startswith(MTP_PREFIX))
