"""Tiny random Qwen2-Audio checkpoints with an offline tokenizer (importable as
``qwen2_audio_checkpoints`` from tests/multimodal): byte-level BPE without merges and
Qwen2-Audio's special tokens; the feature extractor is Whisper's with 128 mel bins."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from qwen_vl_checkpoints import _byte_of, randomize

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_bos|>",
    "<|AUDIO|>",
    "<|audio_eos|>",
]
AUDIO = 256 + SPECIALS.index("<|AUDIO|>")
IM_END = 256 + SPECIALS.index("<|im_end|>")
VOCAB = 320
PREPROCESSOR = {"feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30,
                "n_fft": 400, "padding_value": 0.0, "return_attention_mask": True,
                "feature_extractor_type": "WhisperFeatureExtractor"}  # fmt: skip


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def make_qwen2_audio(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    config = Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                          num_mel_bins=128, max_source_positions=1500),
        text_config=dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, eos_token_id=IM_END, tie_word_embeddings=False),
        audio_token_id=AUDIO,
    )  # fmt: skip
    model = Qwen2AudioForConditionalGeneration(config).eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = IM_END
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


def random_audio(seconds: float, seed: int, rate: int = 16000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.1 * rng.standard_normal(t.size)).astype(
        np.float32
    )


@torch.no_grad()
def hf_generate(path: Path, prompt: str, audios: list, steps: int) -> list[int]:
    from transformers import (
        AutoModelForImageTextToText,
        AutoTokenizer,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    try:
        from transformers import Qwen2AudioForConditionalGeneration as Model
    except ImportError:  # pragma: no cover
        Model = AutoModelForImageTextToText
    model = Model.from_pretrained(path, dtype=torch.float32).eval()
    proc = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128),
                               tokenizer=AutoTokenizer.from_pretrained(path))  # fmt: skip
    inputs = proc(text=[prompt], audio=audios or None, sampling_rate=16000, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
