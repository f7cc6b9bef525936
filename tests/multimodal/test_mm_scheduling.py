"""The per-step encoder budget: no step encodes more media tokens than
``max_num_encoder_input_tokens`` (but for a step's first item), text-only requests keep
getting a token every step while images are admitted, and outputs stay transformers'."""

from __future__ import annotations

import pytest
from qwen_vl_checkpoints import hf_generate, make_qwen_vl, random_image

from tokenmill import LLM, SamplingParams
from tokenmill.multimodal.encoder_budget import EncoderBudget
from tokenmill.multimodal.inputs import MediaItem, MultiModalInputs, PlaceholderRange
from tokenmill.scheduler.request import Request

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
STEPS = 8


def _request(rid: str, runs: list[tuple[int, int]], computed: int = 0) -> Request:
    items = tuple(MediaItem("image", bytes([i]), None, (1, 2, 2 * n), n)  # type: ignore[arg-type]
                  for i, (_, n) in enumerate(runs))  # fmt: skip
    ranges = tuple(PlaceholderRange(o, n) for o, n in runs)
    req = Request(rid, [0] * 100, SamplingParams(), 10, frozenset())
    req.mm_inputs = MultiModalInputs(items, ranges)
    req.num_computed_tokens = computed
    return req


def test_budget_cuts_chunks_before_items_that_do_not_fit():
    budget = EncoderBudget(10)
    a = _request("a", [(5, 8), (20, 8)])
    assert budget.cap(a, 40) == 20  # the first item fits, the second does not: stop before it
    assert budget.cap(a, 40) == 20  # asked again in the same step: the same answer
    b = _request("b", [(0, 4)])
    assert budget.cap(b, 30) == 0  # nothing left for b's image this step
    budget.reset()
    assert budget.cap(b, 30) == 30
    big = _request("c", [(3, 50)])
    budget.reset()
    assert budget.cap(big, 60) == 60  # larger than the budget, but first in its step
    mid = _request("d", [(0, 50)], computed=10)
    assert budget.cap(mid, 20) == 20  # inside a run the encoder already started: free


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl_sched"), seed=6)


def test_steps_respect_the_encoder_budget(ckpt):
    llm = LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=512,
              block_size=4, max_num_encoder_input_tokens=20, check_kv_integrity=True)  # fmt: skip
    model = llm.llm_engine.runner.model
    calls: list[int] = []
    encode = model.encode

    def counting(items):
        calls.append(sum(it.num_tokens for it in items))
        return encode(items)

    model.encode = counting
    imgs = [random_image(140, 112, 20 + i) for i in range(4)]  # 20 tokens each
    cases = [(USER.format(IMG + f"image {i}"), [img]) for i, img in enumerate(imgs)]
    cases.insert(1, (USER.format("a text-only request"), []))
    params = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True)
    prompts = [{"prompt": p, "multi_modal_data": {"image": i}} if i else p for p, i in cases]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert calls == [20, 20, 20, 20]  # one image per step, never two
    for (p, i), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == hf_generate(ckpt, p, i, STEPS)


def test_text_first_steps_defer_new_images_but_never_twice_in_a_row():
    budget = EncoderBudget(100)
    req = _request("a", [(5, 8)])
    budget.reset(text_pending=True)
    assert budget.cap(req, 30) == 5  # the text before the image runs, the image waits
    budget.reset(text_pending=True)
    assert budget.cap(req, 30) == 30  # the next step encodes it even with text pending
    budget.reset(text_pending=False)
    assert budget.cap(_request("b", [(0, 8)]), 10) == 10
