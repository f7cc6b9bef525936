"""The encoder cache and media-aware prefix caching on a tiny Qwen2.5-VL.

The same image in two requests is encoded once; the second request also reuses the KV
cache past the image. A different image in the same place reuses only the blocks before
it (and still gives transformers' tokens); text before an image shares with text-only
requests; the encoder cache serves an image whose placeholders the prefix cache misses.
"""

from __future__ import annotations

import pytest
from qwen_vl_checkpoints import hf_generate, make_qwen_vl, random_image

from tokenmill import LLM, SamplingParams

STEPS = 8
BS = 4
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
HEAD = "<|im_start|>user\nHere is a picture for you to look at: "
TAIL = " what is in it?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl_cache"), seed=1)


def _llm(path, **options) -> LLM:
    options = {"max_model_len": 512, "num_kv_blocks": 512, "block_size": BS, **options}
    return LLM(str(path), dtype="float32", device="cpu", check_kv_integrity=True, **options)


def _run(llm, prompt, image=None):
    params = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True)
    p = prompt if image is None else {"prompt": prompt, "multi_modal_data": {"image": image}}
    [out] = llm.generate(p, params, use_tqdm=False)
    return out


def test_same_image_twice_encodes_once_and_hits_past_it(ckpt):
    llm = _llm(ckpt)
    img = random_image(112, 84, 5)
    first = _run(llm, HEAD + IMG + TAIL, img)
    second = _run(llm, HEAD + IMG + TAIL, img)
    m = llm.get_multimodal_metrics()
    assert m["mm_encoder_runs"] == 1 and m["mm_items_processed"] == 2
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    n = len(second.prompt_token_ids)
    assert second.num_cached_tokens == (n - 1) // BS * BS  # everything but the last block
    assert m["mm_preprocess_seconds"] > 0 and m["mm_encoder_seconds"] > 0


def test_other_image_in_the_same_place_misses_at_the_image(ckpt):
    llm = _llm(ckpt)
    a, b = random_image(112, 84, 6), random_image(112, 84, 7)
    first = _run(llm, HEAD + IMG + TAIL, a)
    second = _run(llm, HEAD + IMG + TAIL, b)
    start = first.prompt_token_ids.index(261)  # the first placeholder
    assert second.num_cached_tokens == start // BS * BS  # the blocks before the image
    assert list(second.outputs[0].token_ids) == hf_generate(ckpt, HEAD + IMG + TAIL, [b], STEPS)
    assert llm.get_multimodal_metrics()["mm_encoder_runs"] == 2


def test_text_before_an_image_shares_with_text_only(ckpt):
    llm = _llm(ckpt)
    text = _run(llm, HEAD + "nothing here, only words, quite a few of them" + TAIL)
    with_image = _run(llm, HEAD + IMG + TAIL, random_image(56, 56, 8))
    start = with_image.prompt_token_ids.index(261)
    common = next(i for i, (x, y) in enumerate(zip(text.prompt_token_ids, with_image.prompt_token_ids)) if x != y)  # fmt: skip
    assert common == start - 1  # <|vision_start|> comes first
    assert with_image.num_cached_tokens == common // BS * BS > 0


def test_encoder_cache_serves_an_image_the_prefix_cache_misses(ckpt):
    llm = _llm(ckpt)
    img = random_image(112, 84, 9)
    _run(llm, HEAD + IMG + TAIL, img)
    other = _run(llm, "<|im_start|>user\nDifferent words first. " + IMG + TAIL, img)
    m = llm.get_multimodal_metrics()
    assert m["mm_encoder_runs"] == 1 and m["mm_encoder_cache_hits"] == 1
    ref = hf_generate(ckpt, "<|im_start|>user\nDifferent words first. " + IMG + TAIL, [img], STEPS)
    assert list(other.outputs[0].token_ids) == ref


def test_encoder_cache_byte_budget_evicts(ckpt):
    llm = _llm(ckpt, mm_encoder_cache_bytes=6 * 64 * 4)  # room for one 6-token image
    imgs = [random_image(84, 56, s) for s in (10, 11)]
    for img in imgs:
        _run(llm, HEAD + IMG + TAIL, img)
    m = llm.get_multimodal_metrics()
    assert m["mm_encoder_cache_entries"] == 1 and m["mm_encoder_cache_evictions"] == 1
    assert m["mm_encoder_cache_bytes"] <= 6 * 64 * 4
