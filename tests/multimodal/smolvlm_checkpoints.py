"""Tiny random SmolVLM checkpoints with an offline tokenizer (importable as
``smolvlm_checkpoints`` from tests/multimodal): byte-level BPE without merges, Idefics3's
image tokens, SmolVLM's chat template, SmolVLM-256M's image-processor settings scaled to
64-pixel tiles."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from qwen_vl_checkpoints import _byte_of, randomize

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>",
            "<image>", "<global-img>",
            *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]  # fmt: skip
IMAGE = 256 + SPECIALS.index("<image>")
EOU = 256 + SPECIALS.index("<end_of_utterance>")
VOCAB = 320
TILE = 64
TILE_TOKENS = (TILE // 8) ** 2 // 2**2  # patch 8, scale factor 2

CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
PREPROCESSOR = {
    "do_image_splitting": True, "max_image_size": {"longest_edge": TILE},
    "size": {"longest_edge": 2 * TILE}, "resample": 1, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "do_pad": True, "image_processor_type": "SmolVLMImageProcessor",
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
        tokenizer_object=tok, eos_token="<end_of_utterance>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


def make_smolvlm(path: Path, seed: int = 0) -> Path:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    config = SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, eos_token_id=EOU, pad_token_id=256),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=TILE, patch_size=8),
        scale_factor=2, image_token_id=IMAGE, tie_word_embeddings=False,
    )  # fmt: skip
    model = SmolVLMForConditionalGeneration(config).eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = EOU
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


def hf_processor(path: Path):
    from transformers import AutoTokenizer, SmolVLMProcessor
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    class ImageOnlyProcessor(SmolVLMProcessor):
        """Without a video processor (transformers' needs torchvision, broken here)."""

        def check_argument_for_proper_class(self, name, arg):
            if arg is not None:
                return super().check_argument_for_proper_class(name, arg)

    import transformers.models.smolvlm.processing_smolvlm as smolvlm_processing

    # num2words only spells out video timestamps; images never need it
    if not smolvlm_processing.num2words:
        smolvlm_processing.num2words = str
    cfg = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    return ImageOnlyProcessor(
        image_processor=SmolVLMImageProcessorPil(**cfg), tokenizer=AutoTokenizer.from_pretrained(path),
        video_processor=None,
        image_seq_len=TILE_TOKENS, chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


@torch.no_grad()
def hf_generate(path: Path, prompt: str, images: list, steps: int, **kwargs) -> list[int]:
    """transformers' greedy tokens; ``kwargs`` go to its processor (e.g. ``size``)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    inputs = hf_processor(path)(
        text=[prompt], images=[images] if images else None, return_tensors="pt", **kwargs
    )
    out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
