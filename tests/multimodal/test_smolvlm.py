"""SmolVLM (Idefics3 family) with images against transformers on random weights: the
processor's tiles, masks and expanded prompt equal transformers'; 32 greedy tokens equal
its ``generate`` for a split image, two images, and a batch with a text-only request."""

from __future__ import annotations

import pytest
import torch
from qwen_vl_checkpoints import random_image
from smolvlm_checkpoints import IMAGE, TILE, TILE_TOKENS, hf_generate, hf_processor, make_smolvlm

from tokenmill import LLM, SamplingParams
from tokenmill.multimodal.options import parse_processor_kwargs

STEPS = 32
USER = "<|im_start|>User:{}<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_smolvlm(tmp_path_factory.mktemp("smolvlm"), seed=3)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=1024, num_kv_blocks=512,
               block_size=4, check_kv_integrity=True)  # fmt: skip


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True)


def test_processor_equals_transformers(llm, ckpt):
    images = [random_image(120, 90, 1), random_image(40, 50, 2)]  # split 2 x 2, and unsplit
    prompt = USER.format("<image>look<image>")
    ref = hf_processor(ckpt)(text=[prompt], images=[images], return_tensors="pt")
    proc = llm.llm_engine.mm_processor
    ids, mm = proc.process(llm.tokenizer.encode(prompt), {"image": images}, proc.defaults)
    assert ids == ref["input_ids"][0].tolist()
    real = [i for i in range(ref["pixel_values"].shape[1]) if ref["pixel_values"][0, i].any()]
    assert len(mm.items) == len(real) == 10  # each: 2 x 2 tiles and the global view
    for item, i in zip(mm.items, real):
        torch.testing.assert_close(item.pixel_values, ref["pixel_values"][0, i], rtol=0, atol=0)
        assert torch.equal(item.pixel_mask, ref["pixel_attention_mask"][0, i].bool())
    assert all(r.length == TILE_TOKENS for r in mm.ranges)
    assert all(ids[r.offset : r.end] == [IMAGE] * r.length for r in mm.ranges)


@pytest.mark.parametrize("sizes", [[(120, 90)], [(40, 50), (100, 64)]])
def test_greedy_equals_transformers(llm, ckpt, sizes):
    images = [random_image(w, h, i + 5) for i, (w, h) in enumerate(sizes)]
    prompt = USER.format("".join("<image>" for _ in images) + "What is here?")
    ref = hf_generate(ckpt, prompt, images, STEPS)
    out = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": images}}, _greedy(), use_tqdm=False
    )
    assert list(out[0].outputs[0].token_ids) == ref


def test_batch_with_text_and_chat(llm, ckpt):
    img = random_image(90, 120, 9)
    prompts = [{"prompt": USER.format("<image>Describe."), "multi_modal_data": {"image": img}},
               USER.format("No picture here.")]  # fmt: skip
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == hf_generate(
        ckpt, USER.format("<image>Describe."), [img], STEPS
    )
    assert list(outs[1].outputs[0].token_ids) == hf_generate(
        ckpt, USER.format("No picture here."), [], STEPS
    )
    msg = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "Describe."}]}]  # fmt: skip
    [chat] = llm.chat(msg, _greedy(), use_tqdm=False)
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert list(chat.outputs[0].token_ids) == hf_generate(ckpt, rendered, [img], STEPS)


# mm_processor_kwargs (ours, vLLM-style) -> what transformers' processor is called with
KWARGS = [
    ({"do_image_splitting": False}, {"do_image_splitting": False}),
    ({"size": {"longest_edge": 3 * TILE}}, {"size": {"longest_edge": 3 * TILE}}),
    ({"images_kwargs": {"size": {"longest_edge": TILE}, "do_image_splitting": True}},
     {"size": {"longest_edge": TILE}, "do_image_splitting": True}),
]  # fmt: skip


@pytest.mark.parametrize("ours, theirs", KWARGS)
def test_processor_kwargs_equal_transformers(llm, ckpt, ours, theirs):
    """Per request: the tiles and expanded prompt transformers' processor makes with the
    same options (the checkpoint's split 120 x 90 into 2 x 2 tiles + the global view)."""
    images = [random_image(120, 90, 1), random_image(200, 70, 2)]
    prompt = USER.format("<image>look<image>")
    ref = hf_processor(ckpt)(text=[prompt], images=[images], return_tensors="pt", **theirs)
    proc = llm.llm_engine.mm_processor
    ids, mm = proc.process(llm.tokenizer.encode(prompt), {"image": images},
                           parse_processor_kwargs(ours))  # fmt: skip
    assert ids == ref["input_ids"][0].tolist()
    real = [i for i in range(ref["pixel_values"].shape[1]) if ref["pixel_values"][0, i].any()]
    assert len(mm.items) == len(real)
    for item, i in zip(mm.items, real):
        torch.testing.assert_close(item.pixel_values, ref["pixel_values"][0, i], rtol=0, atol=0)


def test_processor_kwargs_greedy_and_llm_defaults(llm, ckpt):
    """``size`` per request gives transformers' tokens; ``mm_processor_kwargs`` on the
    ``LLM`` are its defaults, which a request's own options override."""
    img = random_image(120, 90, 4)
    prompt = USER.format("<image>What is here?")
    size = {"longest_edge": 3 * TILE}
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img},
                        "mm_processor_kwargs": {"size": size}}, _greedy(), use_tqdm=False)  # fmt: skip
    assert list(out[0].outputs[0].token_ids) == hf_generate(ckpt, prompt, [img], STEPS, size=size)
    with LLM(str(ckpt), dtype="float32", max_model_len=1024, num_kv_blocks=512, block_size=4,
             mm_processor_kwargs={"do_image_splitting": False}) as one_view:  # fmt: skip
        proc = one_view.llm_engine.mm_processor
        ids = one_view.tokenizer.encode(prompt)
        assert len(proc.process(ids, {"image": img}, parse_processor_kwargs(None))[1].items) == 1
        split = parse_processor_kwargs({"do_image_splitting": True})
        assert len(proc.process(ids, {"image": img}, split)[1].items) == 5  # 2 x 2 + global


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_pixels": 10_000}, r"\['max_pixels'\] do not apply to SmolVLM"),
        ({"do_pan_and_scan": True}, "do not apply to SmolVLM"),
        ({"size": {"longest_edge": 0}}, "longest_edge"),
        ({"size": {"height": 64, "width": 64}}, "longest_edge"),
        ({"size": 128}, "longest_edge"),
        ({"do_image_splitting": "yes"}, "true or false"),
        ({"videos_kwargs": {"size": {"longest_edge": 64}}}, "unknown option"),
    ],
)
def test_bad_processor_kwargs_are_errors(llm, kwargs, match):
    prompt = {"prompt": USER.format("<image>x"), "multi_modal_data": {"image": random_image(40, 40, 0)},
              "mm_processor_kwargs": kwargs}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, _greedy(), use_tqdm=False)
