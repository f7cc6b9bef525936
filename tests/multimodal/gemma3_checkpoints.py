"""Tiny random Gemma 3 vision checkpoints with an offline tokenizer (importable as
``gemma3_checkpoints`` from tests/multimodal): byte-level BPE without merges plus Gemma
3's special tokens, a Gemma-style chat template, and gemma-3-4b-it's real
``preprocessor_config.json`` (896 x 896, 256 tokens per image). The text model has two
sliding-window layers (window 32, far shorter than an image's run) and one global one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from qwen_vl_checkpoints import _byte_of, randomize

SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>"]  # fmt: skip
PAD, EOS, BOS, SOT, EOT, BOI, EOI, IMAGE = range(256, 256 + len(SPECIALS))
VOCAB = 320
TOKENS = 256

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PREPROCESSOR = {
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
    "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 256, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896},
}  # fmt: skip


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<end_of_turn>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )  # fmt: skip


def make_gemma3(path: Path, seed: int = 0) -> Path:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=2048,
                         sliding_window=32, layer_types=["sliding_attention", "sliding_attention",
                                                         "full_attention"],
                         final_logit_softcapping=None, pad_token_id=PAD, bos_token_id=BOS,
                         eos_token_id=EOT),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=896, patch_size=14,
                           vision_use_head=False),
        mm_tokens_per_image=TOKENS, boi_token_index=BOI, eoi_token_index=EOI,
        image_token_index=IMAGE,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = EOT
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


def hf_processor(path: Path):
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    cfg = {
        k: v
        for k, v in PREPROCESSOR.items()
        if v is not None and not k.endswith(("_type", "_class"))
    }
    cfg.pop("image_seq_length")
    return Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(**cfg), tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=CHAT_TEMPLATE, image_seq_length=TOKENS,
    )  # fmt: skip


@torch.no_grad()
def hf_generate(path: Path, prompt: str, images: list, steps: int, **images_kwargs) -> list[int]:
    """transformers' greedy tokens for one prompt (one <start_of_image> per image)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    inputs = hf_processor(path)(
        text=[prompt], images=[images] if images else None, return_tensors="pt", **images_kwargs
    )
    out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
