"""The pooling routes on a real server (uvicorn in a thread) over MiniLM and a tiny
cross-encoder, against sentence-transformers and the offline API."""

from __future__ import annotations

import base64
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import torch.nn.functional as F
from encoder_models import make_encoder
from test_minilm import LONG, SENTENCES

from tokenmill import LLM
from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig


@pytest.fixture(scope="module")
def http(minilm):
    srv = OpenAIServer(minilm.llm_engine, ServerConfig(port=0, log_level="warning", api_key="k"))
    srv.start()
    srv.wait_ready(60)
    with httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": "Bearer k"}) as c:
        yield c
    srv.close(timeout=30)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm_dir):
    path = make_encoder(
        tmp_path_factory.mktemp("ce"), minilm_dir, "BertForSequenceClassification", num_labels=1
    )
    llm = LLM(str(path))
    srv = OpenAIServer(llm.llm_engine, ServerConfig(port=0, log_level="warning")).start()
    srv.wait_ready(60)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield llm, c
    srv.close(timeout=30)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def test_embeddings_match_sentence_transformers(http, sentence_transformer):
    texts = [*SENTENCES, LONG]
    body = _ok(http.post("/v1/embeddings", json={"input": texts, "truncate_prompt_tokens": -1}))
    ref = sentence_transformer.encode(texts, convert_to_tensor=True)
    got = torch.tensor([d["embedding"] for d in body["data"]])
    assert F.cosine_similarity(got, ref, dim=-1).min() >= 0.99999
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 256


def test_base64_decodes_to_the_same_floats(http):
    floats = _ok(http.post("/v1/embeddings", json={"input": "Hello world"}))["data"][0]["embedding"]
    b64 = _ok(
        http.post("/v1/embeddings", json={"input": "Hello world", "encoding_format": "base64"})
    )
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats


def test_token_id_inputs_and_the_openai_client(http, minilm):
    ids = minilm.embed("A man is eating food.")[0].prompt_token_ids
    one = _ok(http.post("/v1/embeddings", json={"input": ids}))["data"]
    two = _ok(http.post("/v1/embeddings", json={"input": [ids, ids]}))["data"]
    assert len(one) == 1 and len(two) == 2
    # Equal to float32 rounding, not bit for bit: the BLAS picks its kernel by the row
    # count (an 8-token input, alone or twice: 1.7e-5 apart in the 384 -> 1536 linear on a
    # Sapphire Rapids core).
    alone, second = torch.tensor(one[0]["embedding"]), torch.tensor(two[1]["embedding"])
    assert torch.allclose(alone, second, rtol=0, atol=1e-5), (alone - second).abs().max()
    assert torch.equal(torch.tensor(two[0]["embedding"]), second)  # same batch, same rows
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k", max_retries=0)
    res = client.embeddings.create(model="model", input=["A man is eating food."])
    assert (
        F.cosine_similarity(
            torch.tensor(res.data[0].embedding), torch.tensor(one[0]["embedding"]), 0
        )
        > 0.99999
    )


def test_score_and_rerank_on_an_embedding_model(http, minilm):
    want = [s.outputs.score for s in minilm.score("a cat", ["a kitten", "stock prices", "a dog"])]
    for path in ("/score", "/v1/score"):
        body = _ok(
            http.post(
                path, json={"text_1": "a cat", "text_2": ["a kitten", "stock prices", "a dog"]}
            )
        )
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = _ok(
            http.post(
                path,
                json={
                    "query": "a cat",
                    "documents": ["a kitten", "stock prices", "a dog"],
                    "top_n": 2,
                },
            )
        )
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [r["index"] for r in body["results"]] == order
        assert (
            body["results"][0]["document"]["text"]
            == ["a kitten", "stock prices", "a dog"][order[0]]
        )
        assert body["results"][0]["relevance_score"] == pytest.approx(want[order[0]], abs=1e-6)


def test_models_says_the_task_and_generation_routes_refuse(http):
    assert _ok(http.get("/v1/models"))["data"][0]["task"] == "embed"
    for path, body in [
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": "m", "prompt": "hi"}),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == 400
        assert "pooling model" in r.json()["error"]["message"]
    assert (
        http.post(
            "/v1/embeddings", json={"input": "hi"}, headers={"Authorization": "Bearer bad"}
        ).status_code
        == 401
    )
    assert _ok(http.post("/pooling", json={"input": "hi"}))["data"][0]["object"] == "pooling"


@pytest.mark.parametrize(
    "path, body, match",
    [
        ("/v1/embeddings", {"input": []}, "empty"),
        ("/v1/embeddings", {"input": ""}, "empty string"),
        ("/v1/embeddings", {"input": LONG}, "truncate_prompt_tokens"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "Matryoshka"),
        ("/v1/embeddings", {"input": [[99999999]]}, "token ids"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "1 -> 1, 1 -> N or N -> N"),
        ("/rerank", {"query": "a", "documents": []}, "empty"),
        ("/classify", {"input": "hi"}, "classify"),
        ("/v1/embeddings", {"input": "hi", "model": "other"}, "does not exist"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_server_keeps_serving(http, path, body, match):
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert match in r.json()["error"]["message"]
    assert _ok(http.post("/v1/embeddings", json={"input": "still serving"}))["data"]


def test_concurrent_clients_get_their_own_results(http, minilm):
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'dogs'}" for i in range(24)]
    want = [o.outputs.embedding for o in minilm.embed(texts)]
    with ThreadPoolExecutor(8) as pool:
        got = list(
            pool.map(
                lambda t: _ok(http.post("/v1/embeddings", json={"input": t}))["data"][0][
                    "embedding"
                ],
                texts,
            )
        )
    assert F.cosine_similarity(torch.tensor(got), torch.tensor(want), dim=-1).min() > 0.99999
    success = [
        line
        for line in http.get("/metrics").text.splitlines()
        if line.startswith('tokenmill:request_success_total{finished_reason="stop"')
    ]
    assert float(success[0].split()[-1]) >= len(texts)


def test_cross_encoder_rerank_and_score(cross_encoder):
    llm, http = cross_encoder
    docs = ["paris is the capital", "bananas are yellow", "france is in europe"]
    want = [s.outputs.score for s in llm.score("capital of france", docs)]
    body = _ok(
        http.post(
            "/rerank",
            json={"query": "capital of france", "documents": docs, "return_documents": False},
        )
    )
    assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -want[i])
    assert body["results"][0]["document"] is None
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        sorted(want, reverse=True), abs=1e-6
    )
    assert _ok(http.get("/v1/models"))["data"][0]["task"] == "score"
    r = http.post("/v1/embeddings", json={"input": "hi"})
    assert (
        r.status_code == 400 and "does not support the 'embed' task" in r.json()["error"]["message"]
    )
    probs = _ok(http.post("/classify", json={"input": ["hi", "there"]}))["data"]
    assert probs[0]["num_classes"] == 1 and 0 < probs[0]["probs"][0] < 1


def test_pooling_routes_on_a_generative_model_refuse(tiny_llm):
    srv = OpenAIServer(tiny_llm.llm_engine, ServerConfig(port=0, log_level="warning")).start()
    try:
        srv.wait_ready(60)
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            for path, body in [
                ("/v1/embeddings", {"input": "hi"}),
                ("/rerank", {"query": "a", "documents": ["b"]}),
                ("/score", {"text_1": "a", "text_2": "b"}),
            ]:
                r = http.post(path, json=body)
                assert r.status_code == 400 and "generative model" in r.json()["error"]["message"]
            assert _ok(http.get("/v1/models"))["data"][0]["task"] == "generate"
            with pytest.raises(ValueError, match="pooling model"):
                tiny_llm.embed("hi")
    finally:
        srv.close(timeout=30)


def test_admission_and_metrics(minilm):
    srv = OpenAIServer(
        minilm.llm_engine, ServerConfig(port=0, log_level="warning", max_queued_requests=0)
    ).start()
    try:
        srv.wait_ready(60)
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/embeddings", json={"input": "hi"})
            assert r.status_code == 429 and r.headers["Retry-After"]
            assert r.json()["error"]["code"] == "queue_full"
            metrics = http.get("/metrics").text
            assert 'request_refused_total{model_name="model",reason="queue_full"} 1.0' in metrics
    finally:
        srv.close(timeout=30)


def test_engine_process_on_is_said_to_apply_to_generation_only(minilm_dir, caplog):
    """A pooling model always runs on the server's engine thread: asking for the engine
    process is answered with a warning, not ignored in silence."""
    import logging

    caplog.set_level(logging.WARNING, "tokenmill.entrypoints.openai.launcher")
    llm = LLM(str(minilm_dir))  # its own engine: the server's close stops it
    srv = OpenAIServer(
        llm.llm_engine, ServerConfig(port=0, log_level="warning", engine_process="on")
    ).start()
    try:
        srv.wait_ready(60)
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
    finally:
        srv.close(timeout=30)
    assert any("applies to generation models only" in r.getMessage() for r in caplog.records)


def test_a_client_that_leaves_has_its_queued_job_dropped(minilm_dir):
    """A non-streaming request whose client disconnects while its job waits behind a
    long one is dropped (counted as cancelled), never run; the server serves on."""
    import threading

    llm = LLM(str(minilm_dir))
    srv = OpenAIServer(llm.llm_engine, ServerConfig(port=0, log_level="warning")).start()
    try:
        srv.wait_ready(60)
        stats = srv.state.llm.stats
        long = ["a long sentence about many things " * 30] * 32  # seconds of work here
        first = threading.Thread(
            target=lambda: httpx.post(f"{srv.url}/v1/embeddings", json={"input": long}, timeout=300)
        )
        first.start()
        deadline = time.monotonic() + 60
        while srv.state.llm.num_live == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the long job is in
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{srv.url}/v1/embeddings", json={"input": ["short"]}, timeout=0.3)
        first.join(300)
        deadline = time.monotonic() + 30
        while stats.cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.cancelled == 1 and stats.completed == 1
        ok = httpx.post(f"{srv.url}/v1/embeddings", json={"input": ["again"]}, timeout=60)
        assert ok.status_code == 200 and stats.completed == 2
    finally:
        srv.close(timeout=30)
