"""Gemma 3 image parts through the OpenAI server with the OpenAI client: a data URL and an
allowed local file give ``LLM.chat``'s text; a corrupt image and a bad option are 400s and
the server keeps serving."""

from __future__ import annotations

import base64
import io

import pytest
from gemma3_checkpoints import make_gemma3
from qwen_vl_checkpoints import random_image

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

openai = pytest.importorskip("openai")


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_media")
    (root / "cat.png").write_bytes(_png(random_image(84, 56, 1)))
    return root


@pytest.fixture(scope="module")
def llm(tmp_path_factory, media_root):
    path = make_gemma3(tmp_path_factory.mktemp("gemma3_srv"), seed=4)
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=1024, num_kv_blocks=512,
               block_size=4, served_model_name="g3", allowed_local_media_path=str(media_root))  # fmt: skip


@pytest.fixture(scope="module")
def client(llm):
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    srv.close(timeout=30)


def _chat(client, *parts, **extra):
    content = [*parts, {"type": "text", "text": "What is this?"}]
    return client.chat.completions.create(
        model="g3", messages=[{"role": "user", "content": content}], max_tokens=8,
        temperature=0, **extra,
    )  # fmt: skip


def test_data_url_and_file_url_give_the_offline_text(client, llm, media_root):
    img = random_image(84, 56, 1)
    msg = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                        {"type": "text", "text": "What is this?"}]}]  # fmt: skip
    [out] = llm.chat(msg, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    expected = out.outputs[0].text
    assert len(out.outputs[0].token_ids) == 8
    assert _chat(client, _url(_png(img))).choices[0].message.content == expected
    file_part = {"type": "image_url", "image_url": {"url": f"file://{media_root}/cat.png"}}
    assert _chat(client, file_part).choices[0].message.content == expected


def test_bad_image_and_bad_option_are_400s(client):
    for parts, extra in (
        ((_url(_png(random_image(30, 30, 2))[:60]),), {}),  # truncated PNG
        ((_url(_png(random_image(30, 30, 2))),), {"extra_body": {"mm_processor_kwargs": {"max_pixels": 9}}}),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, *parts, **extra)
        assert e.value.status_code == 400
    assert _chat(client, _url(_png(random_image(30, 30, 3)))).choices[0].message.content
