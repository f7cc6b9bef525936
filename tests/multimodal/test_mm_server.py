"""Chat content parts with images through the OpenAI server, with the OpenAI client.

A data URL, an allowed local file and the seeds' ``image`` part name give the offline
engine's tokens; every bad input (too many items, pixels over the cap, corrupt or
truncated PNG / JPEG / WEBP / GIF, a non-image behind an image part, a path outside the
allowed root through ``..`` or a symlink, a URL over the size cap, a fetch when fetching
is off) is a 400 with an OpenAI error object, and the server keeps serving.
"""

from __future__ import annotations

import base64
import io
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from qwen_vl_checkpoints import make_qwen_vl, random_image

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

openai = pytest.importorskip("openai")
MAX_BYTES = 200_000


def _encode(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(_encode(random_image(84, 56, 1), "PNG"))
    outside = tmp_path_factory.mktemp("outside") / "secret.png"
    outside.write_bytes(_encode(random_image(84, 56, 2), "PNG"))
    (root / "link.png").symlink_to(outside)
    return root


@pytest.fixture(scope="module")
def llm(tmp_path_factory, media_root):
    path = make_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl_srv"), seed=4)
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=512,
               block_size=4, served_model_name="vl", limit_mm_per_prompt={"image": 2},
               allowed_local_media_path=str(media_root), media_max_bytes=MAX_BYTES,
               media_max_pixels=400 * 400, media_fetch_timeout=1.0)  # fmt: skip


@pytest.fixture(scope="module")
def client(llm):
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    srv.close(timeout=30)


@pytest.fixture(scope="module")
def web():
    """A local http server: /small (a PNG), /big (over the cap), /slow (never answers)."""
    small = _encode(random_image(56, 56, 3), "PNG")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow":
                threading.Event().wait(3)
                return
            body = small if self.path == "/small" else b"\x89PNG" + b"0" * (MAX_BYTES + 10)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _chat(client, *parts, **extra):
    content = [*parts, {"type": "text", "text": "What is this?"}]
    return client.chat.completions.create(
        model="vl", messages=[{"role": "user", "content": content}], max_tokens=8,
        temperature=0, **extra,
    )  # fmt: skip


def _url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _offline(llm, img) -> str:
    msg = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                        {"type": "text", "text": "What is this?"}]}]  # fmt: skip
    [out] = llm.chat(msg, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return out.outputs[0].text


def test_data_url_file_url_and_image_part(client, llm, media_root):
    img = random_image(84, 56, 1)
    expected = _offline(llm, img)
    assert (
        _chat(client, _url(_data_url(_encode(img, "PNG")))).choices[0].message.content == expected
    )
    assert (
        _chat(client, _url(f"file://{media_root}/cat.png")).choices[0].message.content == expected
    )
    seeds = {"type": "image", "image": _data_url(_encode(img, "PNG"))}
    assert _chat(client, seeds).choices[0].message.content == expected


def test_http_fetch(client, llm, web):
    assert _chat(client, _url(web + "/small")).choices[0].message.content == _offline(
        llm, random_image(56, 56, 3)
    )


def _mp4(frames: int = 6) -> bytes:
    """A small MPEG-4 clip (PyAV's encoder) of drifting random frames at 8 fps."""
    import av
    from qwen_vl_checkpoints import random_video

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for frame in random_video(frames, 96, 64, 3):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def test_video_url_equals_the_decoded_frames_offline(client, llm):
    from tokenmill.multimodal.media import decode_video

    data = _mp4()
    frames, meta = decode_video(data, None, 768)
    assert len(frames) == 6 and meta == {"fps": 8.0}
    kwargs = {"videos_kwargs": {"max_pixels": 96 * 64}}
    part = {"type": "video_url", "video_url": {"url": _data_url(data, "video/mp4")}}
    served = _chat(client, part, extra_body={"mm_processor_kwargs": kwargs})
    [direct] = llm.generate({"prompt": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                             "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What is this?"
                             "<|im_end|>\n<|im_start|>assistant\n",
                             "multi_modal_data": {"video": (frames, meta)}, "mm_processor_kwargs": kwargs},
                            SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # fmt: skip
    assert served.choices[0].message.content == direct.outputs[0].text
    assert served.usage.prompt_tokens == len(direct.prompt_token_ids)


def _truncated(fmt: str) -> bytes:
    data = _encode(random_image(200, 150, 7), fmt)
    return data[: len(data) * 2 // 3]


BAD = {
    "too many items": lambda root, web: [_url(_data_url(_encode(random_image(28, 28, i), "PNG"))) for i in range(3)],
    "pixels over cap": lambda root, web: [_url(_data_url(_encode(random_image(500, 400, 0), "PNG")))],
    "corrupt png": lambda root, web: [_url(_data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 50))],
    "truncated png": lambda root, web: [_url(_data_url(_truncated("PNG")))],
    "truncated jpeg": lambda root, web: [_url(_data_url(_truncated("JPEG"), "image/jpeg"))],
    "truncated webp": lambda root, web: [_url(_data_url(_truncated("WEBP"), "image/webp"))],
    "truncated gif": lambda root, web: [_url(_data_url(_truncated("GIF"), "image/gif"))],
    "not an image": lambda root, web: [_url(_data_url(b"just some text, not a picture"))],
    "bmp refused": lambda root, web: [_url(_data_url(_encode(random_image(28, 28, 0), "BMP")))],
    "bad base64": lambda root, web: [_url("data:image/png;base64,@@@")],
    "outside root": lambda root, web: [_url("file:///etc/passwd")],
    "dot dot": lambda root, web: [_url(f"file://{root}/../outside0/secret.png")],
    "symlink out": lambda root, web: [_url(f"file://{root}/link.png")],
    "missing file": lambda root, web: [_url(f"file://{root}/nope.png")],
    "data url over cap": lambda root, web: [_url(_data_url(b"\x89PNG" + b"0" * MAX_BYTES))],
    "http over cap": lambda root, web: [_url(web + "/big")],
    "http timeout": lambda root, web: [_url(web + "/slow")],
    "ftp": lambda root, web: [_url("ftp://example.com/x.png")],
    "corrupt video": lambda root, web: [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}],
    "truncated video": lambda root, web: [{"type": "video_url", "video_url": {"url": _data_url(_mp4()[:3000], "video/mp4")}}],
    "corrupt audio": lambda root, web: [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_media_is_a_400_and_the_server_keeps_serving(client, media_root, web, case):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, *BAD[case](media_root, web))
    body = err.value.body
    assert err.value.status_code == 400 and isinstance(body, dict) and body.get("message")
    assert _chat(client, _url(_data_url(_encode(random_image(28, 28, 9), "PNG")))).choices


def test_bad_mm_processor_kwargs_is_a_400(client):
    part = _url(_data_url(_encode(random_image(28, 28, 0), "PNG")))
    with pytest.raises(openai.BadRequestError, match="both at the top level"):
        _chat(client, part, extra_body={"mm_processor_kwargs": {"max_pixels": 1000, "images_kwargs": {"max_pixels": 2000}}})  # fmt: skip
    from PIL import Image

    flat = Image.new("RGB", (280, 280), (10, 200, 30))  # compresses well under the byte cap
    small = _chat(client, _url(_data_url(_encode(flat, "PNG"))),
                  extra_body={"mm_processor_kwargs": {"max_pixels": 56 * 56}})  # fmt: skip
    assert small.usage.prompt_tokens < 100  # 4 image tokens, not the 100 of 280 x 280


def test_fetch_off_switch():
    from tokenmill.errors import InvalidRequestError
    from tokenmill.multimodal.media import MediaPolicy, image_from_url

    with pytest.raises(InvalidRequestError, match="off on this server"):
        image_from_url("http://127.0.0.1:1/x.png", MediaPolicy(allow_http=False))


def test_text_model_answers_media_with_a_400_naming_it(tiny_llama_dir):
    text_llm = LLM(
        str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, served_model_name="tiny-text"
    )
    srv = OpenAIServer(text_llm.engine, ServerConfig(port=0, log_level="warning")).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="tiny-text"):
            c.chat.completions.create(
                model="tiny-text", max_tokens=2,
                messages=[{"role": "user", "content": [_url(_data_url(_encode(random_image(28, 28, 0), "PNG")))]}],
            )  # fmt: skip
    finally:
        srv.close(timeout=30)


def test_metrics_route_has_the_multimodal_counters(client):
    _chat(client, _url(_data_url(_encode(random_image(28, 28, 42), "PNG"))))
    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    for name in ("mm_items_processed", "mm_encoder_runs", "mm_encoder_cache_hits",
                 "mm_encoder_seconds", "mm_preprocess_seconds"):  # fmt: skip
        assert f'tokenmill:{name}_total{{model_name="vl"}}' in text, name


def _counter(metrics: str, name: str) -> float:
    found = re.search(rf'^tokenmill:{name}_total{{model_name="vl"}} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_engine_process_takes_media(llm, media_root):
    """``--engine-process on``: the server process turns media into placeholder runs and
    pixel tensors (the child's processor, sent in ``Ready``), the engine process encodes
    them. Same tokens as the offline engine, a bad image a 400 that leaves it serving, the
    child's encoder counters and the server's preprocessing counters on /metrics, a clean
    exit."""
    img = random_image(84, 56, 1)
    expected = _offline(llm, img)
    srv = OpenAIServer(
        llm.config, ServerConfig(port=0, log_level="warning", engine_process="on")
    ).start()
    srv.wait_ready()
    core = srv.state.llm
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert _chat(c, _url(_data_url(_encode(img, "PNG")))).choices[0].message.content == expected
        with pytest.raises(openai.BadRequestError):
            _chat(c, *BAD["corrupt png"](media_root, None))
        assert _chat(c, _url(f"file://{media_root}/cat.png")).choices[0].message.content == expected
        other = random_image(56, 84, 5)
        assert _chat(c, _url(_data_url(_encode(other, "PNG")))).choices[0].message.content == (
            _offline(llm, other)
        )
        deadline = time.monotonic() + 10  # the child's counters come with its next snapshot
        while _counter(metrics := httpx.get(srv.url + "/metrics").text, "mm_encoder_runs") < 2:
            assert time.monotonic() < deadline, metrics
            time.sleep(0.05)
        assert _counter(metrics, "mm_items_processed") >= 3  # in the server process
        assert _counter(metrics, "mm_encoder_seconds") > 0  # in the engine process
    finally:
        srv.close(timeout=30)
    assert not core.process.is_alive() and core.process.exitcode == 0
