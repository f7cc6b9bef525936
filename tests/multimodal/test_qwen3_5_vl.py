"""Qwen3.5 vision-language (``Qwen3_5ForConditionalGeneration``) against transformers on
random weights: Qwen3-VL's tower without DeepStack in front of the hybrid language model
(Gated DeltaNet layers and gated attention rotating half of each head by interleaved
M-RoPE). Greedy tokens and their log-probs equal transformers' ``generate`` for a text
prompt, one image, two images and a video (on our processed frame pairs: its video
processor needs torchvision); a batch equals its requests alone; chunked prefill across
an image, the prefix cache (the recurrent state restored from a snapshot past an image,
missed for another image), the encoder cache, and aborted / preempted media requests."""

from __future__ import annotations

import pytest
import torch
from qwen3_5_vl_checkpoints import hf_greedy, hf_inputs, hf_inputs_from, make_qwen3_5_vl
from qwen_vl_checkpoints import IMAGE_PAD, random_image, random_video

from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import RequestOptions

STEPS = 24
BS = 4
ATOL = 2e-4
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CASES = {
    "text": (USER.format("No picture, only a few words here."), {}),
    "one_image": (USER.format(IMG + "What is here?"), {"image": [random_image(120, 90, 5)]}),
    "two_images": (USER.format(IMG + "and" + IMG + "differ how?"),
                   {"image": [random_image(64, 300, 6), random_image(280, 200, 7)]}),
    "video": (USER.format(VIDEO + "What happens?"),
              {"video": [(random_video(8, 64, 48, 21), {"fps": 4.0})]}),  # two frame pairs
}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl"), seed=3)


def _llm(ckpt, **options) -> LLM:
    options = {"max_model_len": 2048, "num_kv_blocks": 1024, "block_size": BS, **options}
    return LLM(str(ckpt), dtype="float32", device="cpu", check_kv_integrity=True, **options)


@pytest.fixture(scope="module")
def llm(ckpt):
    return _llm(ckpt)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True,
                          logprobs=1)  # fmt: skip


def _prompt(case: str) -> str | dict:
    text, data = CASES[case]
    return {"prompt": text, "multi_modal_data": data} if data else text


def _result(out) -> tuple[list[int], torch.Tensor]:
    c = out.outputs[0]
    return list(c.token_ids), torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])


def _generate(llm, cases: list[str]) -> list[tuple[list[int], torch.Tensor]]:
    outs = llm.generate([_prompt(c) for c in cases], _params(), use_tqdm=False)
    return [_result(o) for o in outs]


def _reference(llm, ckpt, case: str) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy run: from its own processor for images (whose ids must equal
    ours), from our processed frame pairs for a video."""
    text, data = CASES[case]
    proc = llm.llm_engine.mm_processor
    ids, mm = proc.process(llm.tokenizer.encode(text), data, proc.defaults) if data else (
        llm.tokenizer.encode(text), None)  # fmt: skip
    if "video" in data:
        return hf_greedy(ckpt, hf_inputs_from(ids, mm), STEPS)
    inputs = hf_inputs(ckpt, text, data.get("image", []))
    assert ids == inputs["input_ids"][0].tolist()
    if mm is not None:
        torch.testing.assert_close(torch.cat([it.pixel_values for it in mm.items]),
                                   inputs["pixel_values"], rtol=0, atol=0)  # fmt: skip
    return hf_greedy(ckpt, inputs, STEPS)


def _assert_same(got, want) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=ATOL)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logprobs_equal_transformers(llm, ckpt, case):
    [got] = _generate(llm, [case])
    _assert_same(got, _reference(llm, ckpt, case))


def test_batch_equals_each_request_alone(llm, ckpt):
    """All four cases in one batch (a fresh engine: no prefix hits) against each alone."""
    alone = [_generate(llm, [case])[0] for case in CASES]
    batched = _generate(_llm(ckpt), list(CASES))
    for got, want in zip(batched, alone):
        _assert_same(got, want)


def test_chunked_prefill_across_the_image_with_a_text_request(ckpt):
    """16-token steps cut the image's 64-token run (and the DeltaNet state) over chunks;
    a text-only request rides along."""
    llm = _llm(ckpt, max_num_batched_tokens=16)
    got = _generate(llm, ["one_image", "text"])
    for result, case in zip(got, ("one_image", "text")):
        _assert_same(result, _reference(llm, ckpt, case))


def _run(llm, text: str, image) -> object:
    prompt = {"prompt": text, "multi_modal_data": {"image": [image]}}
    [out] = llm.generate(prompt, _params(), use_tqdm=False)
    return out


HERE = USER.format("Here: " + IMG + " what is it, and why?")


def test_prefix_cache_resumes_past_the_same_image_not_another(ckpt):
    llm = _llm(ckpt)
    a, b = random_image(100, 80, 13), random_image(100, 80, 14)
    first = _run(llm, HERE, a)
    restores = llm.get_prefix_cache_metrics()["recurrent_snapshot_restores"]
    second = _run(llm, HERE, a)
    start = first.prompt_token_ids.index(IMAGE_PAD)
    assert second.num_cached_tokens > start + first.prompt_token_ids.count(IMAGE_PAD)
    assert llm.get_prefix_cache_metrics()["recurrent_snapshot_restores"] == restores + 1
    _assert_same(_result(second), _result(first))
    other = _run(llm, HERE, b)  # the same text, another image: nothing past the image hits
    assert other.num_cached_tokens <= start
    want = hf_greedy(ckpt, hf_inputs(ckpt, HERE, [b]), STEPS)
    _assert_same(_result(other), want)
    assert llm.get_multimodal_metrics()["mm_encoder_runs"] == 2


def test_encoder_cache_serves_an_image_the_prefix_cache_misses(ckpt):
    llm = _llm(ckpt)
    img = random_image(100, 80, 15)
    _run(llm, HERE, img)
    text = USER.format("Different words first. " + IMG + " what is it?")
    out = _run(llm, text, img)
    m = llm.get_multimodal_metrics()
    assert m["mm_encoder_runs"] == 1 and m["mm_encoder_cache_hits"] == 1
    _assert_same(_result(out), hf_greedy(ckpt, hf_inputs(ckpt, text, [img]), STEPS))


def _add(llm, case: str) -> str:
    """Queue a case on the engine directly (as ``LLM.generate`` does)."""
    engine = llm.llm_engine
    text, data = CASES[case]
    ids = llm.tokenizer.encode(text)
    if not data:
        return engine.add_request(ids, _params())
    ids, mm = engine.mm_processor.process(ids, data, engine.mm_processor.defaults)
    return engine.add_request(ids, _params(), options=RequestOptions(multimodal=mm))


def test_abort_and_preemption_of_media_requests(llm, ckpt):
    """Too few blocks for the four cases at once: some are preempted (their encoder rows
    and recurrent state recomputed); one image request is aborted mid-prefill. The rest
    equal their runs alone, every block and state slot is free at the end, and the aborted
    request run again equals its run alone."""
    alone = {case: _generate(llm, [case])[0] for case in CASES}
    small = _llm(ckpt, max_model_len=256, num_kv_blocks=80, max_num_batched_tokens=32)
    engine = small.llm_engine
    ids = {_add(small, case): case for case in CASES}
    victim = next(r for r, c in ids.items() if c == "two_images")
    done: dict[str, tuple[list[int], torch.Tensor]] = {}
    for step in range(2000):
        if step == 2:
            engine.abort(victim)
        done.update({o.request_id: _result(o) for o in engine.step() if o.finished})
        if not engine.has_unfinished():
            break
    assert engine.scheduler.num_preemptions > 0
    assert victim not in done and set(done) == set(ids) - {victim}
    for rid, result in done.items():
        _assert_same(result, alone[ids[rid]])
    kv = engine.kv
    assert kv.slots.num_free == kv.slots.num_slots and kv.num_free_blocks == kv.num_blocks
    _assert_same(_generate(small, ["two_images"])[0], alone["two_images"])
