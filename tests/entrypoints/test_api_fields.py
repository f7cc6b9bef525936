"""Every request field is honoured or refused: the Responses API's include / top_logprobs /
reasoning.summary, the fields of the three request bodies that are a 400 naming them
(and the harmless values that are not), completions' echo + logprobs alignment and
echo with max_tokens=0, and bad_words through the server."""

from __future__ import annotations

import json

import pytest
from _serving_helpers import MODEL

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

EVENT = TypeAdapter(ResponseStreamEvent)
LOGPROBS = "message.output_text.logprobs"
SHORT = {"model": MODEL, "input": "Say hi", "max_output_tokens": 6, "temperature": 0}


def _events(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for e in events:
        EVENT.validate_python(e)
    return events


def _text_part(body: dict) -> dict:
    [message] = [item for item in body["output"] if item["type"] == "message"]
    return message["content"][0]


# ---- Responses: logprobs --------------------------------------------------------------


def test_output_text_logprobs_when_included(client, http):
    r = client.responses.create(include=[LOGPROBS], top_logprobs=2, **SHORT)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens == 6
    assert "".join(lp.token for lp in part.logprobs) == part.text
    for lp in part.logprobs:
        assert len(lp.top_logprobs) == 2 and lp.logprob <= 0
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
        assert bytes(lp.bytes).decode("utf-8", "replace") == lp.token or not lp.bytes
    raw = http.post("/v1/responses", json={**SHORT, "include": [LOGPROBS]}).json()
    Response.model_validate(raw)
    assert [lp["top_logprobs"] for lp in _text_part(raw)["logprobs"]] == [[]] * 6
    assert raw["top_logprobs"] is None
    plain = http.post("/v1/responses", json=SHORT).json()
    assert _text_part(plain)["logprobs"] == []


def test_streamed_logprobs_match_the_full_response(http):
    body = {**SHORT, "include": [LOGPROBS], "top_logprobs": 1}
    full = _text_part(http.post("/v1/responses", json=body).json())["logprobs"]
    events = _events(http, body)
    deltas = [
        lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]
    ]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    final = _text_part(events[-1]["response"])["logprobs"]

    def rounded(lps):
        return [(lp["token"], round(lp["logprob"], 4), len(lp["top_logprobs"])) for lp in lps]

    assert rounded(deltas) == rounded(done["logprobs"]) == rounded(final) == rounded(full)


# ---- Responses: refused and harmless fields ----------------------------------------------


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"include": ["message.output_text.everything"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs"),
        ({"reasoning": {"summary": "concise"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "low", "budget": 3}}, "reasoning"),
        ({"text": {"verbosity": "high"}}, "text.verbosity"),
        ({"truncation": "auto"}, "truncation"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"background": True}, "background"),
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
    ],
)
def test_responses_fields_not_honoured_are_400s(http, extra, param):
    r = http.post("/v1/responses", json={**SHORT, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split(".")[-1] in error["message"]


def test_responses_harmless_values_are_accepted(http):
    body = {
        **SHORT,
        "reasoning": {"summary": "auto", "effort": None},
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "include": ["web_search_call.action.sources", "file_search_call.results"],
        "truncation": "disabled",
        "background": False,
        "prompt_cache_key": "k",
        "safety_identifier": "u1",
        "service_tier": "auto",
        "max_tool_calls": None,
        "a_field_no_api_defines": 1,
    }
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["service_tier"] == "default"
    Response.model_validate(r.json())


# ---- chat and completions: refused and harmless fields -------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
FUNCTIONS = [{"name": "f", "parameters": {"type": "object"}}]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"functions": FUNCTIONS}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "hi"}}, "prediction"),
        ({"store": True}, "store"),
        ({"verbosity": "low"}, "verbosity"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"logits_processors": ["my.module:Processor"]}, "logits_processors"),
    ],
)
def test_chat_fields_not_honoured_are_400s(http, extra, param):
    r = http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_chat_harmless_values_are_accepted(http):
    body = {
        **CHAT,
        "store": False,
        "modalities": ["text"],
        "verbosity": "medium",
        "metadata": {"a": "b"},
        "prompt_cache_key": "k",
        "safety_identifier": "u",
        "use_beam_search": False,
        "length_penalty": 1.0,
        "guided_decoding_backend": "auto",
    }
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    bad = http.post("/v1/chat/completions", json={**CHAT, "guided_decoding_backend": "outlines"})
    assert bad.status_code == 400 and "guided_decoding_backend" in bad.text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ],
)
def test_completion_fields_not_honoured_are_400s(http, extra, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- completions: echo + logprobs ---------------------------------------------------------

ECHO = {"model": MODEL, "prompt": "Once upon a time", "echo": True, "logprobs": 2, "temperature": 0}


def _check_aligned(choice: dict, prompt_tokens: int) -> None:
    lp = choice["logprobs"]
    n = len(lp["tokens"])
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # no context
    assert all(v is not None for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == choice["text"]
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert lp["text_offset"] == offsets
    assert n >= prompt_tokens


def test_echo_logprobs_first_token_null_and_aligned(http):
    r = http.post("/v1/completions", json={**ECHO, "max_tokens": 3}).json()
    choice, usage = r["choices"][0], r["usage"]
    _check_aligned(choice, usage["prompt_tokens"])
    assert len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"] + 3
    # the same prompt as token ids echoes the same tokens
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": ECHO["prompt"]}).json()["tokens"]
    by_ids = http.post("/v1/completions", json={**ECHO, "prompt": ids, "max_tokens": 3}).json()
    assert by_ids["choices"][0]["logprobs"] == choice["logprobs"]
    # streamed: the chunks' logprobs, joined, are the full response's
    with http.stream(
        "POST", "/v1/completions", json={**ECHO, "max_tokens": 3, "stream": True}
    ) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in joined:
            joined[key] += chunk["choices"][0]["logprobs"][key]
    assert joined["tokens"] == choice["logprobs"]["tokens"]
    assert joined["text_offset"] == choice["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:])


def test_echo_with_max_tokens_0_scores_the_prompt(http):
    r = http.post("/v1/completions", json={**ECHO, "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice, usage = body["choices"][0], body["usage"]
    assert choice["text"] == ECHO["prompt"]
    assert len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"]
    assert usage["completion_tokens"] == 0
    _check_aligned(choice, usage["prompt_tokens"])
    with_text = http.post("/v1/completions", json={**ECHO, "max_tokens": 1}).json()["choices"][0]
    n = usage["prompt_tokens"]
    assert with_text["logprobs"]["token_logprobs"][:n] == choice["logprobs"]["token_logprobs"]
    no_echo = {**ECHO, "echo": False, "max_tokens": 0}
    assert http.post("/v1/completions", json=no_echo).status_code == 400


def test_bad_words_through_the_server(http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    word = plain.split()[0]
    r = http.post("/v1/completions", json={**body, "bad_words": [word]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] != plain
    empty = http.post("/v1/completions", json={**body, "bad_words": [""]})
    assert empty.status_code == 400 and "bad_words" in empty.text


def test_text_logprobs_are_the_message_tokens_only():
    """Reasoning and the text after it: only the tokens that wrote the text are the text's."""
    from tokenmill.entrypoints.openai.serving_responses import _text_logprobs
    from tokenmill.outputs import CompletionOutput, Logprob

    pieces = ["<think>", "why", "</think>", "\n\n", "Hel", "lo"]
    comp = CompletionOutput(
        0,
        "".join(pieces),
        list(range(len(pieces))),
        logprobs=[{i: Logprob(-0.1 * i, 1, p, p.encode())} for i, p in enumerate(pieces)],
    )
    assert [lp["token"] for lp in _text_logprobs(comp, 0, "Hello")] == ["Hel", "lo"]
    assert _text_logprobs(comp, 0, "") == []
    assert len(_text_logprobs(comp, 0, comp.text)) == len(pieces)
    assert _text_logprobs(comp, None, "Hello") is None


def test_every_sdk_request_field_is_declared_or_refused():
    """Each field of the openai SDK's request parameters (pinned in constraints.txt) is a
    field of our request model (honoured) or in its refused table: none is silently
    dropped as unknown."""
    from openai.types import completion_create_params as text
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest

    for params, model in (
        (chat.CompletionCreateParamsBase, ChatCompletionRequest),
        (text.CompletionCreateParamsBase, CompletionRequest),
        (responses.ResponseCreateParamsBase, ResponsesRequest),
    ):
        handled = set(model.model_fields) | set(model.refused)
        assert set(params.__annotations__) - handled == set(), model.__name__


def test_fields_no_api_defines_are_logged(http, caplog):
    with caplog.at_level("WARNING", logger="tokenmill.entrypoints.openai.protocol"):
        r = http.post("/v1/chat/completions", json={**CHAT, "no_such_field": 1})
    assert r.status_code == 200
    assert "no_such_field" in caplog.text
