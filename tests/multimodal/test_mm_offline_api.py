"""The offline multimodal API's checks: every bad input is a ValueError that says what
to change, raised before anything is queued."""

from __future__ import annotations

import pytest
from qwen_vl_checkpoints import make_qwen_vl, random_image

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl_api"), seed=2)
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=256,
               block_size=4, limit_mm_per_prompt={"image": 2})  # fmt: skip


def _gen(llm, prompt, **extra):
    return llm.generate({"prompt": prompt, **extra}, SamplingParams(max_tokens=2), use_tqdm=False)


def test_text_model_refuses_media_naming_it(tiny_llama_dir):
    text_llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match=str(tiny_llama_dir)):
        _gen(text_llm, "hi", multi_modal_data={"image": random_image(28, 28, 0)})
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]  # fmt: skip
    with pytest.raises(ValueError, match="no vision or audio encoder"):
        text_llm.chat(msg, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_pixels": 10_000, "images_kwargs": {"max_pixels": 20_000}}, "both at the top level"),
        ({"min_pixels": 50_000, "max_pixels": 10_000}, "larger than max_pixels"),
        ({"max_pixels": -1}, "positive integer"),
        ({"frobnicate": 2}, "unknown option"),
        ({"images_kwargs": {"fps": 2}}, "unknown option"),
        ({"fps": 2, "nframes": 4}, "not both"),
        ({"fps": 2, "videos_kwargs": {"fps": 1}}, "both at the top level"),
        ({"nframes": 2.5}, "positive integer"),
        ({"images_kwargs": 3}, "must be a dict"),
        ({"do_image_splitting": False}, r"\['do_image_splitting'\] do not apply to Qwen-VL"),
        ({"images_kwargs": {"size": {"longest_edge": 64}}}, r"\['size'\] do not apply to Qwen"),
        ({"do_pan_and_scan": True}, "do not apply to Qwen-VL"),
    ],
)
def test_bad_mm_processor_kwargs(llm, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        _gen(
            llm,
            IMG,
            multi_modal_data={"image": random_image(28, 28, 0)},
            mm_processor_kwargs=kwargs,
        )


def test_mm_processor_kwargs_per_request_and_per_llm(llm):
    img = random_image(280, 280, 1)
    big = _gen(llm, IMG, multi_modal_data={"image": img})
    small = _gen(llm, IMG, multi_modal_data={"image": img},
                 mm_processor_kwargs={"images_kwargs": {"max_pixels": 56 * 56}})  # fmt: skip
    assert (
        len(big[0].prompt_token_ids) == 3 + 100 - 1 and len(small[0].prompt_token_ids) == 3 + 4 - 1
    )
    with pytest.raises(ValueError, match="both at the top level"):
        LLM(None, mm_processor_kwargs={"min_pixels": 1, "images_kwargs": {"min_pixels": 2}})


def test_limit_mm_per_prompt(llm):
    imgs = [random_image(28, 28, i) for i in range(3)]
    with pytest.raises(InvalidRequestError, match="at most 2 allowed"):
        _gen(llm, IMG * 3, multi_modal_data={"image": imgs})
    with pytest.raises(ValueError, match="unknown modality"):
        LLM(None, limit_mm_per_prompt={"smell": 1})


def test_placeholder_count_must_match(llm):
    with pytest.raises(InvalidRequestError, match="1 image placeholder"):
        _gen(llm, IMG, multi_modal_data={"image": [random_image(28, 28, 0)] * 2})
    with pytest.raises(InvalidRequestError, match="not supported by this model yet"):
        _gen(llm, IMG, multi_modal_data={"audio": (b"", 16000)})


def test_bad_images(llm):
    with pytest.raises(InvalidRequestError, match="not an image"):
        _gen(llm, IMG, multi_modal_data={"image": b"definitely not a png"})
    with pytest.raises(InvalidRequestError, match="PIL image"):
        _gen(llm, IMG, multi_modal_data={"image": 42})


def test_command_line_flags_reach_the_engine_config():
    import argparse

    from tokenmill.config import EngineConfig
    from tokenmill.entrypoints.args import add_engine_flags, engine_options

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args([
        "--limit-mm-per-prompt", '{"image": 3}', "--mm-processor-kwargs", '{"max_pixels": 50176}',
        "--mm-encoder-cache-bytes", "64MiB", "--max-num-encoder-input-tokens", "1024",
        "--max-visual-tokens-per-prompt", "4096", "--allowed-local-media-path", "/srv/media",
        "--no-media-fetch", "--media-max-bytes", "1MiB", "--media-fetch-timeout", "2.5",
    ])  # fmt: skip
    fields = EngineConfig.__dataclass_fields__  # (vLLM's compatible flags are LLM's to take)
    config = EngineConfig(**{k: v for k, v in engine_options(args).items() if k in fields})
    assert config.limit_mm_per_prompt == {"image": 3}
    assert config.mm_processor_kwargs == {"max_pixels": 50176}
    assert (config.mm_encoder_cache_bytes, config.media_max_bytes) == (64 << 20, 1 << 20)
    assert (config.max_num_encoder_input_tokens, config.max_visual_tokens_per_prompt) == (
        1024,
        4096,
    )
    assert config.allowed_local_media_path == "/srv/media" and config.allow_media_fetch is False
    assert config.media_fetch_timeout == 2.5


def test_generate_stream_takes_media(llm):
    img = random_image(56, 56, 3)
    prompt = {"prompt": IMG + "hi", "multi_modal_data": {"image": img}}
    params = SamplingParams(temperature=0, max_tokens=4)
    [full] = llm.generate(prompt, params, use_tqdm=False)
    streamed = list(llm.generate_stream(prompt, params))
    assert streamed[-1].outputs[0].token_ids == full.outputs[0].token_ids
    assert len(streamed[-1].prompt_token_ids) == len(full.prompt_token_ids) > 3
