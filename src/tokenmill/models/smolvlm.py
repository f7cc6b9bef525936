"""SmolVLM and Idefics3: a SigLIP tower and pixel-shuffle connector (``smolvlm_vision.py``)
in front of the Llama decoder (our shared one, 1-D rotary).

Images are split into square tiles plus a global view by transformers' image processor;
each tile is one media item whose ``<image>`` run (between its ``<row_i_col_j>`` or
``<global-img>`` marker and ``<fake_token_around_image>``) takes the tile's
(S/P)^2 / r^2 connector outputs (``multimodal/idefics3.py``). Weights:
``model.text_model.*`` / ``lm_head`` for the decoder, ``model.vision_model.*`` and
``model.connector.*`` for the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.smolvlm_vision import (
    Connector,
    SiglipSpec,
    SiglipTower,
    load_vision_weight,
)
from tokenmill.models.weights import load_weights
from tokenmill.multimodal.inputs import MediaItem
from tokenmill.multimodal.model import MultiModalInfo


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    text = dict(hf.get("text_config") or {})
    text.setdefault("model_type", "llama")
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


class _Vision(nn.Module):
    def __init__(self, spec: SiglipSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.vision_model = SiglipTower(spec, dtype)
        self.connector = Connector(spec, dtype)


class SmolVLMForConditionalGeneration(DecoderForCausalLM):
    processor = "smolvlm"
    """The boundary processor (``multimodal/prompt.py``): SmolVLM's image processor."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        max_positions: int | None = None,
        quant: Any = None,
        ops: Any = None,
    ) -> None:
        text = _text_config(hf_config)
        super().__init__(text, dtype, max_positions, quant, ops)
        spec = SiglipSpec.from_hf(hf_config, self.config.hidden_size)
        self.vision = _Vision(spec, dtype)  # HF's model.vision_model / model.connector
        self.vision_spec = spec
        self.multimodal = MultiModalInfo(
            image_token_id=int(hf_config.get("image_token_id", 49190)),
            video_token_id=-1,
            merge_size=spec.scale_factor,
            processor=self.processor,
            tile_tokens=spec.tokens_per_tile,
        )

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Tiles -> their placeholder embeddings [tokens_per_tile, hidden] each."""
        device = next(self.vision.parameters()).device
        tiles = torch.stack([it.pixel_values for it in items]).to(device, self.dtype)
        masks = torch.stack([it.pixel_mask for it in items if it.pixel_mask is not None]).to(device)
        out = self.vision.connector(self.vision.vision_model(tiles, masks)).to(self.dtype)
        return list(out.unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Vision and connector tensors load into the vision module as they stream by."""
        vision: set[str] = set()

        def text_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for prefix in ("model.vision_model.", "model.connector."):
                    if name.startswith(prefix):
                        ours = name[len("model.") :]
                        load_vision_weight(self.vision, ours, tensor)
                        vision.add(ours)
                        break
                else:
                    yield name.replace("model.text_model.", "model.", 1), tensor

        text = nn.Module()  # the decoder's parameters only
        text.model = self.model
        if self.lm_head is not None:
            text.lm_head = self.lm_head
        skip = ("lm_head.weight",) if self.lm_head is None else ()
        loaded = load_weights(text, text_only(), skip=skip)
        if self.vision is None:  # a parallel rank that never encodes
            return loaded
        missing = sorted(dict(self.vision.named_parameters()).keys() - vision)
        if missing:
            from tokenmill.errors import ModelLoadError

            raise ModelLoadError(f"checkpoint is missing vision weights: {', '.join(missing)}")
        return loaded | vision


class Idefics3ForConditionalGeneration(SmolVLMForConditionalGeneration):
    """Idefics3: SmolVLM's layout and weights (SmolVLM is its successor)."""

    processor = "idefics3"
