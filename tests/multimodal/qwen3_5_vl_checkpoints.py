"""Tiny random Qwen3.5 vision-language checkpoints (importable as ``qwen3_5_vl_checkpoints``
from tests/multimodal): Qwen-VL's offline tokenizer and chat template, Qwen3-VL's image and
video processor settings (transformers' processor for ``qwen3_5`` is ``Qwen3VLProcessor``),
a 4-layer hybrid language model with the real ``layer_types`` pattern (three Gated DeltaNet
layers, then gated attention), half of each attention head rotated by interleaved M-RoPE,
and a 2-block tower without DeepStack; the tokenizer spans the model's vocabulary (unused
tokens added) so that log-probs of any id decode. transformers' side: ``hf_greedy`` on its
processor's inputs (``hf_inputs``) or on ours (``hf_inputs_from``: videos)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from qwen3_vl_checkpoints import PREPROCESSOR, VIDEO_PREPROCESSOR
from qwen_vl_checkpoints import (
    IM_END,
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VOCAB,
    make_tokenizer,
)

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [2, 3, 3], "mrope_interleaved": True}  # fmt: skip
"""head_dim 32, 16 dims rotated: 8 frequencies, 2 by time, 3 by height, 3 by width."""


def randomize(model: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    """Every parameter from a seeded generator: the language model's (1 + w) norms around 0,
    the DeltaNet's gated norm and the tower's LayerNorms around 1, decays exp(A_log) in
    (0.4, 2.7)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
            elif name.endswith("dt_bias"):
                p.copy_(noise * 0.5)
            elif "norm" in name:
                centered = "language_model" in name and not name.endswith("linear_attn.norm.weight")
                p.copy_((0.0 if centered else 1.0) + 0.1 * noise)
            else:
                p.copy_(noise * std)


def make_qwen3_5_vl(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16,
                         max_position_embeddings=4096, eos_token_id=IM_END,
                         rope_parameters=dict(ROPE)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, num_position_embeddings=64, patch_size=16),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = IM_END
    model.save_pretrained(path)
    tokenizer = make_tokenizer()  # ids up to the model's vocabulary: log-probs name any
    tokenizer.add_tokens([f"<|unused_{i}|>" for i in range(VOCAB - len(tokenizer))])
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR))
    return path


@functools.cache
def hf_model(path: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def hf_inputs(path: Path, prompt: str, images: list) -> dict:
    """transformers' processor output for a prompt with images (or none)."""
    from qwen3_vl_checkpoints import hf_processor

    return dict(hf_processor(path)(text=[prompt], images=images or None, return_tensors="pt"))


def hf_inputs_from(ids: list[int], mm) -> dict:
    """transformers' inputs from our processed ones (its video processor needs
    torchvision): expanded ids, pixels, one grid per image and per video frame pair."""
    input_ids = torch.tensor([ids])
    out = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
           "mm_token_type_ids": (input_ids == IMAGE_PAD).int() + 2 * (input_ids == VIDEO_PAD).int()}  # fmt: skip
    for kind, px, grid in (("image", "pixel_values", "image_grid_thw"),
                           ("video", "pixel_values_videos", "video_grid_thw")):  # fmt: skip
        items = [it for it in mm.items if it.modality == kind] if mm is not None else []
        if items:
            out[px] = torch.cat([it.pixel_values for it in items])
            out[grid] = torch.tensor([it.grid_thw for it in items])
    return out


@torch.no_grad()
def hf_greedy(path: Path, inputs: dict, steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and their log-probs [steps] (EOS banned for ``steps``)."""
    model = hf_model(path)
    model.model.rope_deltas = None  # a cached model keeps the last request's M-RoPE offset
    out = model.generate(
        **inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.logits, tokens)]
    return tokens, torch.stack(logprobs)
