"""Qwen2-Audio against transformers on random weights: 32 greedy tokens equal its
``generate`` for clips under 30 s (one and two clips, batched with text); a clip over 30 s
is cut into windows, every sample kept (transformers' processor keeps only the first
30 s), and audio at another rate is resampled."""

from __future__ import annotations

import pytest
from qwen2_audio_checkpoints import AUDIO, hf_generate, make_qwen2_audio, random_audio

from tokenmill import LLM, SamplingParams

STEPS = 32
CLIP = "<|audio_bos|><|AUDIO|><|audio_eos|>"
USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"), seed=5)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=4096, num_kv_blocks=2048,
               block_size=4, check_kv_integrity=True)  # fmt: skip


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True)


@pytest.mark.parametrize("seconds", [[2.5], [1.0, 4.0]])
def test_greedy_equals_transformers(llm, ckpt, seconds):
    clips = [random_audio(s, i) for i, s in enumerate(seconds)]
    prompt = USER.format("".join(CLIP for _ in clips) + "What is said?")
    ref = hf_generate(ckpt, prompt, clips, STEPS)
    data = {"audio": [(c, 16000) for c in clips]}
    outs = llm.generate(
        [{"prompt": prompt, "multi_modal_data": data}, USER.format("text")],
        _greedy(),
        use_tqdm=False,
    )
    assert list(outs[0].outputs[0].token_ids) == ref
    assert list(outs[1].outputs[0].token_ids) == hf_generate(ckpt, USER.format("text"), [], STEPS)


def test_long_audio_is_windowed_not_cut(llm):
    proc = llm.llm_engine.mm_processor
    ids, mm = proc.process(
        llm.tokenizer.encode(CLIP), {"audio": (random_audio(65.0, 1), 16000)}, proc.defaults
    )
    assert [it.grid_thw[2] for it in mm.items] == [3000, 3000, 500]  # 30 s + 30 s + 5 s of frames
    assert [it.num_tokens for it in mm.items] == [750, 750, 125]
    assert ids.count(AUDIO) == 750 + 750 + 125
    out = llm.generate({"prompt": USER.format(CLIP), "multi_modal_data": {"audio": (random_audio(65.0, 1), 16000)}},
                       SamplingParams(max_tokens=2), use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 2


def test_other_sampling_rates_are_resampled(llm):
    proc = llm.llm_engine.mm_processor
    clip = random_audio(2.0, 3, rate=8000)
    _, mm = proc.process(llm.tokenizer.encode(CLIP), {"audio": (clip, 8000)}, proc.defaults)
    assert mm.items[0].grid_thw[2] == 200  # 2 s at 100 frames per second


def _wav(samples, rate: int = 16000) -> str:
    import base64
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return base64.b64encode(buf.getvalue()).decode()


def test_input_audio_through_the_server_equals_generate(llm, ckpt):
    openai = pytest.importorskip("openai")
    from tokenmill.entrypoints.openai.launcher import OpenAIServer
    from tokenmill.entrypoints.openai.state import ServerConfig

    clip = random_audio(3.0, 7)
    template = (  # Qwen2-Audio's chat template, shortened
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for content in "
        "message['content'] %}{% if 'audio' in content %}<|audio_bos|><|AUDIO|><|audio_eos|>"
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant{{ '\\n' }}"  # (jinja drops a trailing newline)
    )
    srv = OpenAIServer(
        llm.engine, ServerConfig(port=0, log_level="warning", chat_template=template)
    ).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        content = [{"type": "input_audio", "input_audio": {"data": _wav(clip), "format": "wav"}},
                   {"type": "text", "text": "What is said?"}]  # fmt: skip
        served = client.chat.completions.create(model=ckpt.name, max_tokens=8, temperature=0, logprobs=True,
                                                messages=[{"role": "user", "content": content}])  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=ckpt.name, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])  # fmt: skip
    finally:
        srv.close(timeout=30)
    [direct] = llm.generate({"prompt": USER.format(CLIP + "What is said?"), "multi_modal_data": {"audio": (clip, 16000)}},
                            SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # fmt: skip
    # byte-level tokens of random weights are rarely whole UTF-8: compare the tokens' bytes
    assert served.usage.prompt_tokens == len(direct.prompt_token_ids)
    served_bytes = b"".join(bytes(t.bytes) for t in served.choices[0].logprobs.content)
    direct_bytes = b"".join(llm.tokenizer.token_bytes(t) for t in direct.outputs[0].token_ids)
    assert served_bytes == direct_bytes
