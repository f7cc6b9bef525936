"""POST /v1/chat/completions through the official openai client (sync and async)."""

from __future__ import annotations

import asyncio
import json

import pytest
from _serving_helpers import MODEL, chat_body

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


def test_typed_response_and_exact_usage(client, server, http):
    assert http.post("/reset_prefix_cache").status_code == 200  # shared server: earlier tests
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.message.content
    prompt_ids = server.state.tokenizer.apply_chat_template(MESSAGES)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == len(prompt_ids) + 7
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_stream_equals_non_stream(client):
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats(http):
    body = chat_body(
        max_tokens=5,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
        for c, n in zip(chunks, counts)
    )


def test_n_greater_than_one_streamed_and_not(client):
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert full.usage.completion_tokens == 18
    texts = {i: "" for i in range(3)}
    finishes = {i: [] for i in range(3)}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert [texts[i] for i in range(3)] == [c.message.content for c in full.choices]
    assert all(f == ["length"] for f in finishes.values())


def test_seed_reproducible_and_temperature_matters(client):
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    a = client.chat.completions.create(seed=11, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=11, **kwargs).choices[0].message.content
    c = client.chat.completions.create(seed=12, **kwargs).choices[0].message.content
    assert a == b and a != c


def test_stop_string_and_stop_token_ids(client, http):
    base = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]
    second = (
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=3,
            temperature=0,
            logprobs=True,
        )
        .choices[0]
        .logprobs.content[1]
        .token
    )
    [stop_id] = http.post("/tokenize", json={"prompt": second, "add_special_tokens": False}).json()[
        "tokens"
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop_id
    assert r.usage.completion_tokens == 2


def test_logprobs_and_limits(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=5
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 5
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: top-1 chosen
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True
        )
        assert bytes(t.bytes).decode() == t.token
    import openai

    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=21
        )
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, top_logprobs=2)


def test_extra_fields_and_template_options(client, server):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES + [{"role": "assistant", "content": "The sea is"}],
        max_tokens=4,
        temperature=0,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "echo": True,
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "skip_special_tokens": True,
            "prompt_logprobs": 1,
        },
    )
    assert r.choices[0].message.content.startswith("The sea is")
    prompt_logprobs = r.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == r.usage.prompt_tokens


def test_content_parts_are_joined(client):
    parts = [{"type": "text", "text": "Tell me about"}, {"type": "text", "text": "the sea"}]
    r = client.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0, messages=[{"role": "user", "content": parts}]
    )
    joined = client.chat.completions.create(
        model=MODEL,
        max_tokens=3,
        temperature=0,
        messages=[{"role": "user", "content": "Tell me about\nthe sea"}],
    )
    assert r.choices[0].message.content == joined.choices[0].message.content


def test_async_client_concurrent(aclient, client):
    async def run():
        async def one(i):
            return await aclient.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Question {i}"}],
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True},
            )

        return await asyncio.gather(*(one(i) for i in range(6)))

    results = asyncio.run(run())
    for i, r in enumerate(results):
        alone = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Question {i}"}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].message.content == alone.choices[0].message.content


def test_cached_tokens_reported_on_a_repeated_prompt(client):
    """Prefix caching: the second identical prompt reuses full KV blocks (4 tokens each)."""
    import uuid

    messages = [{"role": "user", "content": "A question about the sea"}]
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        temperature=0,
        extra_body={"cache_salt": uuid.uuid4().hex},
    )  # nothing cached before
    first = client.chat.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(**kwargs)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 4 == 0
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_cache_salt_isolates_and_priority_is_accepted(client):
    import uuid

    messages = [{"role": "user", "content": f"Salted question {uuid.uuid4().hex} about rivers"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    client.chat.completions.create(extra_body={"cache_salt": "a"}, **kwargs)
    other = client.chat.completions.create(extra_body={"cache_salt": "b", "priority": 5}, **kwargs)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    same = client.chat.completions.create(extra_body={"cache_salt": "a", "priority": -1}, **kwargs)
    assert same.usage.prompt_tokens_details.cached_tokens > 0
