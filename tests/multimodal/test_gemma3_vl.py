"""Gemma 3 with images against transformers on random weights (a 3-layer decoder whose
sliding window, 32, is far shorter than an image's 256-token run; gemma-3-4b-it's real
processor settings): the expanded prompt and pixels equal its processor's (pan-and-scan
too); 32 greedy tokens equal its ``generate`` for one image, two images of other sizes,
pan-and-scan crops, a batch with a text-only request, and chunked prefill, which never
cuts an image's run (its tokens attend to each other bidirectionally)."""

from __future__ import annotations

import pytest
import torch
from gemma3_checkpoints import BOI, IMAGE, TOKENS, hf_generate, hf_processor, make_gemma3
from qwen_vl_checkpoints import random_image

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError

STEPS = 32
USER = "<bos><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gemma3(tmp_path_factory.mktemp("gemma3_vl"), seed=2)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=2048, num_kv_blocks=1024,
               block_size=4, check_kv_integrity=True)  # fmt: skip


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True)


def _run(llm, prompt: str, images: list, **kwargs) -> list[int]:
    p = {"prompt": prompt, "multi_modal_data": {"image": images}, **kwargs} if images else prompt
    [out] = llm.generate(p, _greedy(), use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("pan", [False, True])
def test_processor_equals_transformers(llm, ckpt, pan):
    images = [random_image(1200, 400, 1), random_image(50, 40, 2)]  # wide: 3 crops with pan
    prompt = USER.format("<start_of_image>and<start_of_image>")
    ref = hf_processor(ckpt)(text=[prompt], images=[images], return_tensors="pt",
                             do_pan_and_scan=pan)  # fmt: skip
    proc = llm.llm_engine.mm_processor
    from tokenmill.multimodal.options import parse_processor_kwargs

    opts = parse_processor_kwargs({"do_pan_and_scan": pan})
    ids, mm = proc.process(llm.tokenizer.encode(prompt), {"image": images}, opts)
    assert ids == ref["input_ids"][0].tolist()
    assert len(mm.items) == ref["pixel_values"].shape[0] == (5 if pan else 2)
    for item, px in zip(mm.items, ref["pixel_values"]):
        torch.testing.assert_close(item.pixel_values, px, rtol=0, atol=0)
    marked = [i for i, t in enumerate(ref["token_type_ids"][0].tolist()) if t == 1]
    assert marked == [i for r in mm.ranges for i in range(r.offset, r.end)]
    assert mm.bidirectional and all(r.length == TOKENS for r in mm.ranges)
    assert all(ids[r.offset - 1] == BOI and ids[r.offset] == IMAGE for r in mm.ranges)


@pytest.mark.parametrize("sizes", [[(120, 90)], [(40, 50), (300, 160)]])
def test_greedy_equals_transformers(llm, ckpt, sizes):
    images = [random_image(w, h, i + 5) for i, (w, h) in enumerate(sizes)]
    prompt = USER.format("Look: " + "".join("<start_of_image>" for _ in images) + "What is here?")
    assert _run(llm, prompt, images) == hf_generate(ckpt, prompt, images, STEPS)


def test_pan_and_scan_equals_transformers(llm, ckpt):
    img = random_image(1200, 400, 8)
    prompt = USER.format("<start_of_image>Describe.")
    kwargs = {"mm_processor_kwargs": {"images_kwargs": {"do_pan_and_scan": True}}}
    ours = _run(llm, prompt, [img], **kwargs)
    assert ours == hf_generate(ckpt, prompt, [img], STEPS, do_pan_and_scan=True)
    assert ours != _run(llm, prompt, [img])  # the crops are seen


def test_batch_with_text_and_chat(llm, ckpt):
    img = random_image(90, 120, 9)
    prompts = [{"prompt": USER.format("<start_of_image>Describe."), "multi_modal_data": {"image": img}},
               USER.format("No picture here.")]  # fmt: skip
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == hf_generate(
        ckpt, USER.format("<start_of_image>Describe."), [img], STEPS
    )
    assert list(outs[1].outputs[0].token_ids) == hf_generate(
        ckpt, USER.format("No picture here."), [], STEPS
    )
    msg = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                        {"type": "text", "text": "Describe."}]}]  # fmt: skip
    [chat] = llm.chat(msg, _greedy(), use_tqdm=False)
    assert list(chat.outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)


def test_chunked_prefill_keeps_each_run_whole(ckpt):
    """A 300-token step budget: chunks end before a run rather than inside it."""
    llm = LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=2048, num_kv_blocks=1024,
              block_size=4, max_num_batched_tokens=300)  # fmt: skip
    sched = llm.llm_engine.scheduler
    chunks: list[tuple[int, int]] = []
    schedule = sched.schedule

    def recording():
        out = schedule()
        chunks.extend((s.start, s.end) for s in out.seqs if s.end - s.start > 1)
        return out

    sched.schedule = recording
    images = [random_image(64, 64, 11), random_image(100, 30, 12)]
    text = "Two pictures for you. " * 4
    prompt = USER.format(f"{text}The first <start_of_image>and the second <start_of_image>ok?")
    assert _run(llm, prompt, images) == hf_generate(ckpt, prompt, images, STEPS)
    runs = [(r.offset, r.end) for r in _mm(llm, prompt, images).ranges]
    assert runs[0][0] < 300 < runs[0][1]  # a 300-token first chunk would cut the first run
    assert chunks[0] == (0, runs[0][0])  # it ends before the run instead
    for a, b in runs:
        assert any(s <= a and b <= e for s, e in chunks)  # each run inside one chunk


def _mm(llm, prompt, images):
    proc = llm.llm_engine.mm_processor
    return proc.process(llm.tokenizer.encode(prompt), {"image": images}, proc.defaults)[1]


def test_a_run_longer_than_a_step_is_refused(ckpt):
    llm = LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=2048, num_kv_blocks=1024,
              block_size=4, max_num_batched_tokens=200)  # fmt: skip
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        _run(llm, USER.format("<start_of_image>"), [random_image(64, 64, 1)])


def test_same_image_twice_encodes_once_and_hits_past_it(ckpt):
    llm = LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=2048, num_kv_blocks=1024,
              block_size=4, check_kv_integrity=True)  # fmt: skip
    img, other = random_image(80, 60, 13), random_image(80, 60, 14)
    prompt = USER.format("Here: <start_of_image> what is it?")
    first = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": img}}, _greedy(), use_tqdm=False
    )[0]
    second = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": img}}, _greedy(), use_tqdm=False
    )[0]
    m = llm.get_multimodal_metrics()
    assert m["mm_encoder_runs"] == 1 and m["mm_encoder_cache_hits"] == 0  # the KV hit past it
    n = len(second.prompt_token_ids)
    assert second.num_cached_tokens == (n - 1) // 4 * 4
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    third = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": other}}, _greedy(), use_tqdm=False
    )[0]
    start = third.prompt_token_ids.index(IMAGE)
    assert third.num_cached_tokens == start // 4 * 4  # the blocks before the other image
    assert list(third.outputs[0].token_ids) == hf_generate(ckpt, prompt, [other], STEPS)
    moved = USER.format("Another text first, then: <start_of_image> what is it?")
    fourth = _run(llm, moved, [img])  # the prefix cache misses, the encoder cache hits
    m = llm.get_multimodal_metrics()
    assert m["mm_encoder_runs"] == 2 and m["mm_encoder_cache_hits"] == 1
    assert fourth == hf_generate(ckpt, moved, [img], STEPS)


def test_options_that_do_not_apply_are_errors(llm):
    img = random_image(64, 64, 1)
    with pytest.raises(InvalidRequestError, match="do not apply to Gemma 3"):
        _run(llm, USER.format("<start_of_image>"), [img], mm_processor_kwargs={"max_pixels": 10**6})
    with pytest.raises(InvalidRequestError, match="true or false"):
        _run(
            llm, USER.format("<start_of_image>"), [img], mm_processor_kwargs={"do_pan_and_scan": 1}
        )
    with pytest.raises(InvalidRequestError, match="1 <start_of_image>"):
        _run(llm, USER.format("<start_of_image>"), [img, img])
