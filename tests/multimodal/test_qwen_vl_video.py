"""Qwen2.5-VL with video: frame sampling, processing and 32 greedy tokens against
transformers on random weights.

transformers' video processor needs torchvision (not usable with this torch), so the
processing is checked piece by piece against transformers' own rules: each frame equals
what its image processor makes of that frame, the patch layout is its ``patchify``'s,
frame sampling its ``sample_frames``'; the model side (the tower over t x h x w grids,
temporal M-RoPE) is checked by handing our processed inputs to its ``generate``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qwen_vl_checkpoints import (
    VIDEO_PAD,
    hf_generate_inputs,
    hf_processor,
    make_qwen_vl,
    random_image,
    random_video,
)

from tokenmill import LLM, SamplingParams
from tokenmill.multimodal.options import parse_processor_kwargs
from tokenmill.multimodal.video import VideoConfig, VideoOptions, patchify, sample_indices

STEPS = 32
VID = "<|vision_start|><|video_pad|><|vision_end|>"
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
SMALL = {"videos_kwargs": {"min_pixels": 3136, "max_pixels": 112 * 84}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl_video"), seed=11)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=1024, num_kv_blocks=512,
               block_size=4, check_kv_integrity=True)  # fmt: skip


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True)


def test_each_frame_is_what_the_image_processor_makes_of_it(llm, ckpt):
    frame = np.asarray(random_image(100, 70, 3))
    proc = llm.llm_engine.mm_processor
    ids, mm = proc.process(llm.tokenizer.encode(VID), {"video": np.stack([frame, frame])},
                           parse_processor_kwargs({"videos_kwargs": {"min_pixels": 3136, "max_pixels": 12845056}}))  # fmt: skip
    ref = hf_processor(ckpt)(text=[IMG], images=[random_image(100, 70, 3)], return_tensors="pt")
    [item] = mm.items
    assert list(item.grid_thw) == ref["image_grid_thw"][0].tolist()
    torch.testing.assert_close(item.pixel_values, ref["pixel_values"], rtol=0, atol=0)
    assert ids.count(VIDEO_PAD) == item.num_tokens == item.pixel_values.shape[0] // 4


def test_patch_layout_is_transformers_patchify():
    cfg = VideoConfig()
    frames = np.random.default_rng(0).standard_normal((3, 3, 56, 84)).astype(np.float32)
    ours, grid = patchify(frames, cfg)
    # transformers' Qwen2VLVideoProcessor.patchify, on [B, T, C, H, W] (the last frame repeated)
    v = torch.from_numpy(np.concatenate([frames, frames[-1:]]))[None]
    gt, gh, gw = 2, 4, 6
    ref = v.view(1, gt, 2, 3, gh // 2, 2, 14, gw // 2, 2, 14).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    assert grid == (gt, gh, gw)
    assert np.array_equal(ours, ref.reshape(gt * gh * gw, 3 * 2 * 14 * 14).numpy())


@pytest.mark.parametrize(
    "total, fps, opts, expected",
    [
        (10, None, VideoOptions(), list(range(10))),
        (10, None, VideoOptions(nframes=4), [0, 2, 5, 7]),
        (48, 24.0, VideoOptions(fps=2.0), [0, 12, 24, 36]),  # 2 s at 2 fps; at least min_frames
        (240, 24.0, VideoOptions(fps=1.0), [0, 24, 48, 72, 96, 120, 144, 168, 192, 216]),
    ],
)
def test_frame_sampling_follows_transformers(total, fps, opts, expected):
    assert sample_indices(total, fps, VideoConfig(), opts) == expected


def test_video_greedy_equals_transformers(llm, ckpt):
    prompt = USER.format(VID + "What happens?")
    video = (random_video(6, 96, 64, 1), {"fps": 12})
    ids, mm = llm.llm_engine.mm_processor.process(
        llm.tokenizer.encode(prompt), {"video": video}, parse_processor_kwargs(SMALL)
    )
    [item] = mm.items
    assert item.grid_thw[0] == 3 and item.time_interval == pytest.approx(4 * 2 / 12)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": video},
                        "mm_processor_kwargs": SMALL}, _greedy(), use_tqdm=False)  # fmt: skip
    assert list(out[0].outputs[0].token_ids) == hf_generate_inputs(ckpt, ids, mm, STEPS)


def test_image_and_video_in_one_prompt_batched_with_text(llm, ckpt):
    prompt = USER.format("first " + IMG + " then " + VID + " end")
    data = {"image": random_image(84, 56, 4), "video": random_video(4, 84, 56, 5)}
    kwargs = {**SMALL, "videos_kwargs": {**SMALL["videos_kwargs"], "nframes": 4}}
    ids, mm = llm.llm_engine.mm_processor.process(
        llm.tokenizer.encode(prompt), data, parse_processor_kwargs(kwargs)
    )
    assert [it.modality for it in mm.items] == ["image", "video"]
    text = USER.format("words only")
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": data, "mm_processor_kwargs": kwargs}, text],
                        _greedy(), use_tqdm=False)  # fmt: skip
    assert list(outs[0].outputs[0].token_ids) == hf_generate_inputs(ckpt, ids, mm, STEPS)
    text_ids = llm.tokenizer.encode(text)
    from tokenmill.multimodal.inputs import MultiModalInputs

    assert list(outs[1].outputs[0].token_ids) == hf_generate_inputs(
        ckpt, text_ids, MultiModalInputs((), ()), STEPS
    )


def test_visual_token_budget_shared_by_images_and_video(llm):
    from tokenmill.errors import InvalidRequestError
    from tokenmill.multimodal.processing import QwenVLProcessor

    base = llm.llm_engine.mm_processor

    def with_budget(n):
        return QwenVLProcessor(base.info, base.image_processor, base.defaults, base.limits,
                               None, base.video, max_visual_tokens=n)  # fmt: skip

    ids = llm.tokenizer.encode(IMG + VID)
    data = {"image": random_image(84, 56, 1), "video": random_video(8, 96, 64, 2)}
    opts = parse_processor_kwargs(SMALL)
    _, full = with_budget(None).process(ids, data, opts)
    assert [it.num_tokens for it in full.items] == [6, 24]  # 4 frame pairs of 2 x 3 tokens
    _, cut = with_budget(20).process(ids, data, opts)
    assert [it.num_tokens for it in cut.items] == [6, 12]  # the video keeps 2 pairs
    assert cut.items[1].time_interval == pytest.approx(2 * full.items[1].time_interval)
    with pytest.raises(InvalidRequestError, match="images take 6 tokens"):
        with_budget(5).process(ids, data, opts)
    with pytest.raises(InvalidRequestError, match="frame pair takes 6 tokens"):
        with_budget(8).process(ids, data, opts)
