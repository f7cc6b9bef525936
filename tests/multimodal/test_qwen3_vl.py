"""Qwen3-VL (dense) with images against transformers on random weights (interleaved
M-RoPE, DeepStack from two tower blocks, Qwen3-VL-2B's processor settings): the expanded
prompt and patches equal its processor's; 32 greedy tokens equal its ``generate`` for one
image, two of other sizes, a batch with a text-only request, and chunked prefill cutting
the runs (DeepStack rows follow the chunks); the encoder and prefix caches; video refused."""

from __future__ import annotations

import pytest
import torch
from qwen3_vl_checkpoints import hf_generate, hf_processor, make_qwen3_vl
from qwen_vl_checkpoints import IMAGE_PAD, random_image, random_video

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError

STEPS = 32
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), seed=3)


def _llm(ckpt, **options) -> LLM:
    options = {"max_model_len": 2048, "num_kv_blocks": 1024, "block_size": 4, **options}
    return LLM(str(ckpt), dtype="float32", device="cpu", check_kv_integrity=True, **options)


@pytest.fixture(scope="module")
def llm(ckpt):
    return _llm(ckpt)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True)


def _run(llm, prompt: str, images: list):
    p = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
    [out] = llm.generate(p, _greedy(), use_tqdm=False)
    return out


def test_processor_equals_transformers(llm, ckpt):
    images = [random_image(120, 90, 1), random_image(300, 200, 2)]
    prompt = USER.format(IMG + "and" + IMG)
    ref = hf_processor(ckpt)(text=[prompt], images=images, return_tensors="pt")
    proc = llm.llm_engine.mm_processor
    ids, mm = proc.process(llm.tokenizer.encode(prompt), {"image": images}, proc.defaults)
    assert ids == ref["input_ids"][0].tolist()
    torch.testing.assert_close(torch.cat([it.pixel_values for it in mm.items]),
                               ref["pixel_values"], rtol=0, atol=0)  # fmt: skip
    assert [it.grid_thw for it in mm.items] == [tuple(g) for g in ref["image_grid_thw"].tolist()]


@pytest.mark.parametrize("sizes", [[(120, 90)], [(64, 300), (280, 200)]])
def test_greedy_equals_transformers(llm, ckpt, sizes):
    images = [random_image(w, h, i + 5) for i, (w, h) in enumerate(sizes)]
    prompt = USER.format("".join(IMG for _ in images) + "What is here?")
    assert list(_run(llm, prompt, images).outputs[0].token_ids) == hf_generate(
        ckpt, prompt, images, STEPS
    )


def test_batch_with_text_and_chunked_prefill(ckpt):
    """48-token steps: every run is cut across chunks; a text-only request rides along."""
    llm = _llm(ckpt, max_num_batched_tokens=48)
    img = random_image(150, 100, 9)
    with_image = USER.format("Look " + IMG + "and tell.")
    outs = llm.generate([{"prompt": with_image, "multi_modal_data": {"image": img}},
                         USER.format("No picture here.")], _greedy(), use_tqdm=False)  # fmt: skip
    assert list(outs[0].outputs[0].token_ids) == hf_generate(ckpt, with_image, [img], STEPS)
    assert list(outs[1].outputs[0].token_ids) == hf_generate(
        ckpt, USER.format("No picture here."), [], STEPS
    )


def test_encoder_and_prefix_caches(ckpt):
    llm = _llm(ckpt)
    img = random_image(100, 80, 13)
    prompt = USER.format("Here: " + IMG + " what is it?")
    first, second = _run(llm, prompt, [img]), _run(llm, prompt, [img])
    n = len(second.prompt_token_ids)
    assert second.num_cached_tokens == (n - 1) // 4 * 4  # the KV past the image hit
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    other_text = USER.format("Something else first. " + IMG + " what is it?")
    third = _run(llm, other_text, [img])  # the prefix misses, the encoder cache hits
    m = llm.get_multimodal_metrics()
    assert m["mm_encoder_runs"] == 1 and m["mm_encoder_cache_hits"] == 1
    assert third.prompt_token_ids.count(IMAGE_PAD) == first.prompt_token_ids.count(IMAGE_PAD)
    assert list(third.outputs[0].token_ids) == hf_generate(ckpt, other_text, [img], STEPS)


def test_video_is_refused_with_a_clear_error(llm):
    prompt = USER.format("<|vision_start|><|video_pad|><|vision_end|>")
    with pytest.raises(InvalidRequestError, match="images only"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"video": random_video(4, 64, 64, 1)}},
                     _greedy(), use_tqdm=False)  # fmt: skip
