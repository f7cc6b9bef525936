"""Qwen3-VL (dense) with images against transformers on random weights (interleaved
M-RoPE, DeepStack from two tower blocks, Qwen3-VL-2B's processor settings): the expanded
prompt and patches equal its processor's; 32 greedy tokens equal its ``generate`` for one
image, two of other sizes, a batch with a text-only request, and chunked prefill cutting
the runs (DeepStack rows follow the chunks); the encoder and prefix caches; video as
timestamped frame pairs (sampling, sizes and timestamps as transformers' rules, its
``generate`` on our processed inputs: its video processor needs torchvision)."""

from __future__ import annotations

import re

import pytest
import torch
from qwen3_vl_checkpoints import hf_generate, hf_generate_inputs, hf_processor, make_qwen3_vl
from qwen_vl_checkpoints import IMAGE_PAD, random_image, random_video

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.options import parse_processor_kwargs

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


VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def test_video_sampling_resizing_and_timestamps_follow_transformers():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_resize
    from transformers.video_utils import VideoMetadata

    from tokenmill.multimodal.qwen3_video import (
        QWEN3_VIDEO,
        pair_timestamps,
        sample_indices,
        smart_resize,
    )
    from tokenmill.multimodal.video import VideoOptions

    hf = Qwen3VLVideoProcessor()
    for total, fps, opts in ((30, 10.0, VideoOptions()), (300, 30.0, VideoOptions()),
                             (9, None, VideoOptions()), (50, 25.0, VideoOptions(fps=4.0)),
                             (50, 25.0, VideoOptions(nframes=7))):  # fmt: skip
        meta = VideoMetadata(total_num_frames=total, fps=fps)
        ours = sample_indices(total, fps, QWEN3_VIDEO, opts)
        assert ours == hf.sample_frames(meta, num_frames=opts.nframes, fps=opts.fps).tolist()
        for tp in (2,):
            assert pair_timestamps(ours, fps or 24.0, tp) == Qwen3VLProcessor._calculate_timestamps(
                None, list(ours), fps or 24.0, tp
            )
    for frames, h, w in ((4, 48, 64), (40, 720, 1280), (7, 20, 300)):
        assert smart_resize(frames, h, w, QWEN3_VIDEO, 131072, 786432) == hf_resize(
            frames, h, w, temporal_factor=2, factor=32, min_pixels=131072, max_pixels=786432
        )


@pytest.mark.parametrize("with_image", [False, True])
def test_video_greedy_equals_transformers_on_our_inputs(llm, ckpt, with_image):
    """Timestamped frame pairs as transformers' processor writes them (checked against the
    text it builds from the same grid and timestamps), then its generate on our pixels."""

    video = (random_video(8, 64, 48, 21), {"fps": 4.0})  # 4 frames sampled: two pairs
    images = [random_image(90, 70, 22)] if with_image else []
    prompt = USER.format((IMG if with_image else "") + VIDEO + "What happens?")
    data = {"video": [video], **({"image": images} if images else {})}
    proc = llm.llm_engine.mm_processor
    ids, mm = proc.process(llm.tokenizer.encode(prompt), data, proc.defaults)
    pairs = [it for it in mm.items if it.modality == "video"]
    assert len(pairs) == 2 and all(it.grid_thw[0] == 1 for it in pairs)
    per_pair = pairs[0].num_tokens
    text = "".join(f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_pair
                   + "<|vision_end|>" for t in (0.25, 1.5))  # frames 0, 2 / 5, 7 at 4 fps  # fmt: skip
    expected = prompt.replace("<|video_pad|>", text)
    if with_image:
        expected = expected.replace("<|image_pad|>", "<|image_pad|>" * mm.items[0].num_tokens)
    assert ids == llm.tokenizer.encode(expected)
    [out] = llm.generate({"prompt": prompt, "multi_modal_data": data}, _greedy(), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_generate_inputs(ckpt, ids, mm, STEPS)


def test_visual_token_budget_samples_within_it(ckpt):
    """``max_visual_tokens_per_prompt``: a video's share first lowers its frames' total
    pixels (Qwen3-VL's sizing rule; the frames kept), which is its own ``max_pixels``
    exactly; where the smallest frames still do not fit, fewer pairs are sampled. The
    images' tokens come first, and images alone over the budget are an error."""
    video = (random_video(32, 128, 96, 21), {"fps": 4.0})  # 16 frames sampled: 8 pairs of 12
    prompt = USER.format(VIDEO)
    free = _llm(ckpt)
    proc = free.llm_engine.mm_processor
    ids = free.tokenizer.encode(prompt)
    _, unbounded = proc.process(ids, {"video": [video]}, parse_processor_kwargs(None))
    assert [it.num_tokens for it in unbounded.items] == [12] * 8
    llm = _llm(ckpt, max_visual_tokens_per_prompt=60)
    budget = llm.llm_engine.mm_processor
    got_ids, got = budget.process(ids, {"video": [video]}, parse_processor_kwargs(None))
    same = parse_processor_kwargs({"videos_kwargs": {"max_pixels": 60 * 2 * 32 * 32}})
    want_ids, want = proc.process(ids, {"video": [video]}, same)
    assert got_ids == want_ids and len(got.items) == 8
    assert sum(it.num_tokens for it in got.items) <= 60
    for a, b in zip(got.items, want.items):
        assert torch.equal(a.pixel_values, b.pixel_values)
    [out] = llm.generate({"prompt": prompt, "multi_modal_data": {"video": [video]}}, _greedy(),
                         use_tqdm=False)  # fmt: skip
    assert list(out.outputs[0].token_ids) == hf_generate_inputs(ckpt, got_ids, got, STEPS)
    tiny = _llm(ckpt, max_visual_tokens_per_prompt=5)
    tiny_ids, few = tiny.llm_engine.mm_processor.process(
        ids, {"video": [video]}, parse_processor_kwargs(None)
    )
    assert [it.num_tokens for it in few.items] == [1] * 5  # fewer pairs, evenly spread
    stamps = [float(x) for x in re.findall(r"<([0-9.]+) seconds>", tiny.tokenizer.decode(tiny_ids))]
    assert len(stamps) == 5 and stamps == sorted(stamps) and stamps[-1] - stamps[0] > 6
    image = random_image(512, 512, 3)
    with pytest.raises(InvalidRequestError, match="max_visual_tokens_per_prompt"):
        llm.generate({"prompt": USER.format(IMG + VIDEO), "multi_modal_data":
                      {"image": image, "video": [video]}}, _greedy(), use_tqdm=False)  # fmt: skip
