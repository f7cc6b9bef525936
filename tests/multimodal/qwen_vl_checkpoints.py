"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints with an offline tokenizer (importable as
``qwen_vl_checkpoints`` from tests/multimodal).

The tokenizer is byte-level BPE without merges (ids 0-255 are the bytes) plus Qwen-VL's
special tokens and the real Qwen2-VL chat template; the image processor settings are
Qwen2.5-VL-7B-Instruct's ``preprocessor_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 258, 259, 260, 261, 262
VOCAB = 384

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}  # fmt: skip


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


def _byte_of(c: str) -> int:
    """GPT-2's byte <-> printable-character table, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[c]


def randomize(model: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    """Every parameter from a seeded generator (norm weights around 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise * std)


def make_qwen_vl(path: Path, seed: int = 0, generation: str = "2.5", tie: bool = False) -> Path:
    """A 2-layer Qwen2.5-VL (or Qwen2-VL) with a 2-block vision tower, saved with the
    tokenizer and the real preprocessor config."""
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        eos_token_id=IM_END, bos_token_id=None, pad_token_id=256,
    )  # fmt: skip
    ids = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
               vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)  # fmt: skip
    if generation == "2.5":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model

        vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64,
                      out_hidden_size=64, fullatt_block_indexes=[1], window_size=112)  # fmt: skip
    else:
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model

        vision = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64)
    config = Config(text_config=text, vision_config=vision, tie_word_embeddings=tie, **ids)
    model = Model(config).eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = IM_END
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


def random_image(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_processor(path: Path):
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        """Without a video processor (transformers' needs torchvision, broken here)."""

        def check_argument_for_proper_class(self, name, arg):
            if arg is not None:
                return super().check_argument_for_proper_class(name, arg)

    cfg = {
        k: v for k, v in PREPROCESSOR.items() if not k.endswith("_type") and k != "processor_class"
    }
    return ImageOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil(**cfg), tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


@torch.no_grad()
def hf_generate(path: Path, prompt: str, images: list, steps: int) -> list[int]:
    """transformers' greedy tokens for one prompt (text with one placeholder per image)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    proc = hf_processor(path)
    inputs = proc(text=[prompt], images=images or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def random_video(frames: int, width: int, height: int, seed: int) -> np.ndarray:
    """[T, H, W, 3] uint8 frames: a random picture drifting one pixel per frame."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width + frames, 3), dtype=np.uint8)
    return np.stack([base[:, t : t + width] for t in range(frames)])


@torch.no_grad()
def hf_generate_inputs(path: Path, ids: list[int], mm, steps: int) -> list[int]:
    """transformers' greedy tokens from already processed inputs (its video processor needs
    torchvision): our expanded ids, pixel values, grids and temporal steps."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    kinds = {"image": [], "video": []}
    for it in mm.items:
        kinds[it.modality].append(it)
    kwargs = {
        "mm_token_type_ids": (input_ids == IMAGE_PAD).int() + 2 * (input_ids == VIDEO_PAD).int()
    }
    if kinds["image"]:
        kwargs["pixel_values"] = torch.cat([it.pixel_values for it in kinds["image"]])
        kwargs["image_grid_thw"] = torch.tensor([it.grid_thw for it in kinds["image"]])
    if kinds["video"]:
        kwargs["pixel_values_videos"] = torch.cat([it.pixel_values for it in kinds["video"]])
        kwargs["video_grid_thw"] = torch.tensor([it.grid_thw for it in kinds["video"]])
        tps = model.config.vision_config.tokens_per_second
        kwargs["second_per_grid_ts"] = torch.tensor(
            [it.time_interval / tps for it in kinds["video"]]
        )
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, **kwargs)  # fmt: skip
    return out[0, len(ids) :].tolist()
