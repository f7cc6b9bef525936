"""Speculation behind the OpenAI server (SmolLM2, suffix decoding): the same text as
without it, ``disable_spec_decode`` per request, and the spec_decode_* counters in
/metrics under tokenmill's and vLLM's names."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

TEXT = "Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!"


def _chat(http: httpx.Client, model: str, **extra) -> str:
    body = {
        "model": model, "max_tokens": 40, "temperature": 0,
        "messages": [{"role": "user", "content": "Repeat exactly:\n\n" + TEXT}], **extra,
    }  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _counters(http: httpx.Client) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
        if "spec_decode" in s.name and "per_pos" not in s.name
    }


def test_server_speculates_with_the_same_text(smollm2_gguf):
    with LLM(str(smollm2_gguf), max_model_len=512) as plain:
        want = plain.chat(
            [{"role": "user", "content": "Repeat exactly:\n\n" + TEXT}],
            SamplingParams(temperature=0, max_tokens=40),
            use_tqdm=False,
        )[0].outputs[0].text  # fmt: skip
    spec = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(smollm2_gguf), max_model_len=512, speculative_config=spec)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            assert _chat(http, model) == want
            after_first = _counters(http)
            assert after_first["tokenmill:spec_decode_num_accepted_tokens_total"] > 0
            assert (after_first["vllm:spec_decode_num_draft_tokens_total"]
                    == after_first["tokenmill:spec_decode_num_draft_tokens_total"])  # fmt: skip
            assert _chat(http, model, disable_spec_decode=True) == want
            assert _counters(http) == after_first  # nothing drafted for that request
    finally:
        srv.close(timeout=30)
        llm.close()
