"""Qwen2.5-VL / Qwen2-VL with images against transformers on random weights.

A 2-layer checkpoint with a 2-block vision tower (window attention in block 0, full in
block 1) and the real Qwen2.5-VL image-processor settings: the processor's outputs must
equal transformers' (pixel values, grids, placeholder runs), and the engine's 32 greedy
tokens must equal transformers' ``generate`` for the same image(s), alone, batched with
text-only requests, and with chunked prefill cutting an image's placeholder run.
"""

from __future__ import annotations

import pytest
import torch
from qwen_vl_checkpoints import (
    IMAGE_PAD,
    hf_generate,
    hf_processor,
    make_qwen_vl,
    random_image,
)

from tokenmill import LLM, SamplingParams

STEPS = 32
USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl"), seed=0)


@pytest.fixture(scope="module")
def images():
    return [random_image(84, 56, 1), random_image(140, 112, 2), random_image(60, 200, 3)]


def _llm(path, **options) -> LLM:
    options = {"max_model_len": 512, "num_kv_blocks": 512, "block_size": 4, **options}
    return LLM(str(path), dtype="float32", device="cpu", check_kv_integrity=True, **options)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_processor_outputs_equal_transformers(ckpt, images):
    llm = _llm(ckpt)
    proc = llm.llm_engine.mm_processor
    prompt = USER.format(IMG + "a" + IMG + "b")
    ref = hf_processor(ckpt)(text=[prompt], images=images[:2], return_tensors="pt")
    ids, mm = proc.process(llm.tokenizer.encode(prompt), {"image": images[:2]}, proc.defaults)
    assert ids == ref["input_ids"][0].tolist()
    pixels = torch.cat([it.pixel_values for it in mm.items])
    torch.testing.assert_close(pixels, ref["pixel_values"], rtol=0, atol=0)
    assert [list(it.grid_thw) for it in mm.items] == ref["image_grid_thw"].tolist()
    assert [r.length for r in mm.ranges] == [it.num_tokens for it in mm.items]
    assert all(ids[r.offset : r.end] == [IMAGE_PAD] * r.length for r in mm.ranges)


def test_processor_kwargs_resize_like_transformers(ckpt, images):
    llm = _llm(ckpt, mm_processor_kwargs={"max_pixels": 56 * 56})
    proc = llm.llm_engine.mm_processor
    prompt = USER.format(IMG)
    ids, mm = proc.process(llm.tokenizer.encode(prompt), {"image": images[1]}, proc.defaults)
    hp = hf_processor(ckpt)
    ref = hp(text=[prompt], images=[images[1]], images_kwargs={"size": {"shortest_edge": 3136, "longest_edge": 56 * 56}}, return_tensors="pt")  # fmt: skip
    assert [list(mm.items[0].grid_thw)] == ref["image_grid_thw"].tolist() == [[1, 2, 4]]
    assert ids == ref["input_ids"][0].tolist()


def test_one_image_greedy_equals_transformers(ckpt, images):
    prompt = USER.format(IMG + "Describe the picture.")
    ref = hf_generate(ckpt, prompt, [images[0]], STEPS)
    llm = _llm(ckpt)
    out = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": images[0]}}, _greedy(), use_tqdm=False
    )
    assert _tokens(out) == [ref]


def test_batch_with_text_only_requests(ckpt, images):
    cases = [
        (USER.format(IMG + "one"), [images[0]]),
        (USER.format("only text here"), []),
        (USER.format("two " + IMG + " and " + IMG + " end"), [images[1], images[2]]),
        (USER.format("more text, a longer one this time"), []),
    ]
    refs = [hf_generate(ckpt, p, imgs, STEPS) for p, imgs in cases]
    llm = _llm(ckpt)
    prompts = [
        {"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in cases
    ]
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == refs


def test_chunked_prefill_splits_the_placeholder_run(ckpt, images):
    prompt = USER.format("look: " + IMG + " now")
    ref = hf_generate(ckpt, prompt, [images[1]], STEPS)
    llm = _llm(ckpt, long_prefill_token_threshold=7, max_num_batched_tokens=16)
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": images[1]}}, USER.format("text")]
    out = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert _tokens(out)[0] == ref
    assert _tokens(out)[1] == hf_generate(ckpt, USER.format("text"), [], STEPS)


def test_qwen2_vl(tmp_path, images):
    path = make_qwen_vl(tmp_path, seed=3, generation="2")
    prompt = USER.format(IMG + "What is it?")
    ref = hf_generate(path, prompt, [images[1]], STEPS)
    out = _llm(path).generate(
        {"prompt": prompt, "multi_modal_data": {"image": images[1]}}, _greedy(), use_tqdm=False
    )
    assert _tokens(out) == [ref]


def test_chat_image_url_equals_generate(ckpt, images):
    import base64
    import io

    buf = io.BytesIO()
    images[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]}]  # fmt: skip
    llm = _llm(ckpt)
    chat = llm.chat(messages, _greedy(), use_tqdm=False)
    rendered = hf_processor(ckpt).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert _tokens(chat) == [hf_generate(ckpt, rendered, [images[0]], STEPS)]


@pytest.mark.parametrize("options", [
    {"num_kv_blocks": 48, "max_model_len": 160},  # preemption: the pool holds ~1.5 prompts
    {"async_scheduling": "on"},  # the next step launched before the last one is collected
    {"enable_prefix_caching": False, "max_num_seqs": 2},
])  # fmt: skip
def test_image_requests_under_preemption_and_async_scheduling(ckpt, images, options):
    cases = [(USER.format(IMG + f"number {i}"), [images[i % 3]]) for i in range(3)]
    cases.insert(1, (USER.format("plain words"), []))
    refs = [hf_generate(ckpt, p, imgs, STEPS) for p, imgs in cases]
    llm = _llm(ckpt, **options)
    prompts = [
        {"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in cases
    ]
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == refs
    if "num_kv_blocks" in options:
        assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.gpu
def test_one_image_on_cuda_equals_transformers(ckpt, images):
    """The same greedy tokens on a CUDA device (float32; not run on CPU-only machines)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompt = USER.format(IMG + "Describe the picture.")
    ref = hf_generate(ckpt, prompt, [images[0]], STEPS)
    llm = LLM(str(ckpt), dtype="float32", device="cuda", max_model_len=512, num_kv_blocks=512,
              block_size=16)  # fmt: skip
    out = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": images[0]}}, _greedy(), use_tqdm=False
    )
    assert _tokens(out) == [ref]


def test_native_float32_kernel_when_asked(ckpt, images, monkeypatch):
    """``TOKENMILL_FP32_GEMM=native``: the language model's weights resolve to the native
    float32 kernel's tiles and the tower's ``nn.Linear`` layers become ``NativeLinear``;
    the tower's embeddings equal the PyTorch path's to float32 rounding, and the first
    greedy tokens after the image are the same (only the first few: float32 sums in another
    order flip this random model's near-ties later on)."""
    from tokenmill import native
    from tokenmill.quant.dense16 import NativeLinear

    if native.active_isa() is None:
        pytest.skip("no native kernels here")
    prompt = {"prompt": USER.format(IMG + "one"), "multi_modal_data": {"image": [images[1]]}}
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, ignore_eos=True)
    out = {}
    for mode in ("native", "torch"):
        monkeypatch.setenv("TOKENMILL_FP32_GEMM", mode)
        llm = _llm(ckpt)
        model = llm.engine.loaded.model
        towers = [m for m in model.visual.modules() if isinstance(m, NativeLinear)]
        plain = [m for m in model.visual.modules() if type(m) is torch.nn.Linear]
        assert (bool(towers), bool(plain)) == (mode == "native", mode == "torch")
        assert llm.engine.loaded.quantization == ("fp32" if mode == "native" else "none")
        proc = llm.llm_engine.mm_processor
        ids, mm = proc.process(llm.tokenizer.encode(prompt["prompt"]), {"image": [images[1]]},
                               proc.defaults)  # fmt: skip
        (emb,) = model.encode(mm.items)
        (res,) = llm.generate([prompt], params, use_tqdm=False)
        out[mode] = emb, list(res.outputs[0].token_ids)
    (emb_n, tokens_n), (emb_t, tokens_t) = out["native"], out["torch"]
    torch.testing.assert_close(emb_n, emb_t, rtol=1e-4, atol=1e-4)
    assert tokens_n == tokens_t


def test_logprobs_name_rows_past_the_tokenizer(ckpt):
    """This checkpoint's output rows (384) outrun its tokenizer (a padded vocabulary, as
    Qwen's 151936 rows over 151665 tokens): a logprob of such a row has no text and no
    bytes, instead of failing the step; the engine serves the next request."""
    llm = _llm(ckpt)
    vocab = llm.tokenizer.vocab_size
    assert vocab < 384
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    (out,) = llm.generate(USER.format("only text here"), params, use_tqdm=False)
    positions = out.outputs[0].logprobs
    past = [lp for pos in positions for t, lp in pos.items() if t >= vocab]
    assert past  # the case happens here: random rows rank past the tokenizer's
    assert all(lp.decoded_token == "" and lp.bytes == b"" for lp in past)
    inside = [lp for pos in positions for t, lp in pos.items() if t < vocab]
    assert inside and all(lp.bytes for lp in inside)
    (again,) = llm.generate(USER.format("more"), _greedy(), use_tqdm=False)
    assert len(again.outputs[0].token_ids) == STEPS


def test_bundle_keeps_the_native_float32_layers(ckpt, images, tmp_path, monkeypatch):
    """With the native float32 kernel the towers' linears become ``NativeLinear`` after the
    load; the bundle written then maps into the same modules at the next start (warm, no
    rebuild) and gives the same tokens."""
    from tokenmill import native
    from tokenmill.quant.dense16 import NativeLinear

    if native.active_isa() is None:
        pytest.skip("no native kernels here")
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", "native")
    prompt = {"prompt": USER.format(IMG + "one"), "multi_modal_data": {"image": [images[0]]}}
    runs = []
    for _ in range(2):
        with _llm(ckpt, prepare_bundle=True, cache_dir=str(tmp_path)) as llm:
            loaded = llm.engine.loaded
            towers = any(isinstance(m, NativeLinear) for m in loaded.model.visual.modules())
            (out,) = llm.generate([prompt], _greedy(), use_tqdm=False)
            runs.append(("bundle write" in loaded.phases, towers, out.outputs[0].token_ids))
    (wrote, cold_towers, cold), (rewrote, warm_towers, warm) = runs
    assert (wrote, rewrote) == (True, False)
    assert cold_towers and warm_towers and list(warm) == list(cold)
