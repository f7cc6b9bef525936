"""POST /v1/completions: prompt forms, echo, logprobs, streaming, and what is refused."""

from __future__ import annotations

import json

import pytest
from _serving_helpers import MODEL

GREEDY = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


def test_string_prompt_typed_and_usage(client, http):
    r = client.completions.create(prompt="Once upon a time", **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_default_max_tokens_is_16(client):
    r = client.completions.create(
        model=MODEL, prompt="Once", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16


def test_list_of_prompts_and_token_ids(client, http):
    prompts = ["Once upon a time", "The three laws"]
    batch = client.completions.create(prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(prompt=p, **GREEDY).choices[0].text for p in prompts]
    assert [c.text for c in batch.choices] == [singles[0]] * 2 + [singles[1]] * 2
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    by_ids = client.completions.create(prompt=ids, **GREEDY)
    assert [c.text for c in by_ids.choices] == singles
    one = client.completions.create(prompt=ids[0], **GREEDY)
    assert one.choices[0].text == singles[0]
    assert batch.usage.prompt_tokens == sum(map(len, ids))
    assert batch.usage.completion_tokens == 4 * 6


def test_stream_equals_non_stream_with_usage(client):
    full = client.completions.create(prompt=["Alpha", "Beta"], **GREEDY)
    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(
        prompt=["Alpha", "Beta"], stream=True, stream_options={"include_usage": True}, **GREEDY
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons.setdefault(c.index, []).append(c.finish_reason)
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.text for c in full.choices]
    assert reasons == {0: ["length"], 1: ["length"]}
    assert usage.completion_tokens == 12 and usage.prompt_tokens == full.usage.prompt_tokens


def test_logprobs_and_echo(client):
    r = client.completions.create(prompt="Once upon a time", logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    echoed = client.completions.create(prompt="Once upon a time", logprobs=1, echo=True, **GREEDY)
    choice = echoed.choices[0]
    assert choice.text == "Once upon a time" + r.choices[0].text
    n_prompt = echoed.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == n_prompt + 6
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])


def test_echo_streamed(client):
    chunks = list(client.completions.create(prompt="Once upon", echo=True, stream=True, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(prompt="Once upon", echo=True, **GREEDY)
    assert text == full.choices[0].text and text.startswith("Once upon")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("suffix", "tail", "suffix"),
        ("best_of", 3, "best_of"),
        ("logprobs", 21, "logprobs"),
        ("prompt", [], "prompt"),
        ("prompt", "", "empty"),
        ("prompt", [[1, 2], []], "empty"),
        ("prompt", [10**7], "token ids"),
        ("temperature", -1, "temperature"),
        ("n", 0, "n must be"),
        ("stop_token_ids", [10**7], "stop_token_ids"),
    ],
)
def test_refused_with_400(http, field, value, match):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["type"] == "invalid_request_error"


def test_stream_options_without_stream_refused(http):
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]


def test_sse_framing(http):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        json.loads(event[6:])
