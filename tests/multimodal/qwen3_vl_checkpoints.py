"""Tiny random Qwen3-VL checkpoints (importable as ``qwen3_vl_checkpoints`` from
tests/multimodal): Qwen-VL's offline tokenizer and chat template (``qwen_vl_checkpoints``),
Qwen3-VL-2B-Instruct's image-processor settings (16-pixel patches, 0.5 mean / std, at
least 256 x 256 pixels), a 3-layer decoder with interleaved M-RoPE and a 3-block tower
with DeepStack features from blocks 0 and 1."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from qwen_vl_checkpoints import (
    CHAT_TEMPLATE,
    IM_END,
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VOCAB,
    make_tokenizer,
    randomize,
)

PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}  # fmt: skip


def make_qwen3_vl(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=4096, eos_token_id=IM_END,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1], patch_size=16),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3VLForConditionalGeneration(config).eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = IM_END
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR))
    return path


def hf_processor(path: Path):
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class ImageOnlyProcessor(Qwen3VLProcessor):
        """Without a video processor (transformers' needs torchvision, broken here)."""

        def check_argument_for_proper_class(self, name, arg):
            if arg is not None:
                return super().check_argument_for_proper_class(name, arg)

    cfg = {k: v for k, v in PREPROCESSOR.items() if not k.endswith(("_type", "_class"))}
    return ImageOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil(**cfg), tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


@torch.no_grad()
def hf_generate(path: Path, prompt: str, images: list, steps: int) -> list[int]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    inputs = hf_processor(path)(text=[prompt], images=images or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


VIDEO_PREPROCESSOR = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "min_frames": 4, "max_frames": 768, "fps": 2,
    "video_processor_type": "Qwen3VLVideoProcessor",
}  # fmt: skip
"""transformers' Qwen3VLVideoProcessor defaults, written out (``make_qwen3_vl`` saves them)."""


@torch.no_grad()
def hf_generate_inputs(path: Path, ids: list[int], mm, steps: int) -> list[int]:
    """transformers' greedy tokens from our processed inputs (its video processor needs
    torchvision): expanded ids, pixels, one grid per image and per video frame pair."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    kwargs = {
        "mm_token_type_ids": (input_ids == IMAGE_PAD).int() + 2 * (input_ids == VIDEO_PAD).int()
    }
    for kind, px, grid in (("image", "pixel_values", "image_grid_thw"),
                           ("video", "pixel_values_videos", "video_grid_thw")):  # fmt: skip
        items = [it for it in mm.items if it.modality == kind]
        if items:
            kwargs[px] = torch.cat([it.pixel_values for it in items])
            kwargs[grid] = torch.tensor([it.grid_thw for it in items])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, **kwargs)  # fmt: skip
    return out[0, len(ids) :].tolist()
