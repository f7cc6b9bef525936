"""Build ``openai_responses.json``: JSON schemas of the OpenAI API's response bodies.

Source: the official ``openai`` Python SDK's pydantic response types (Apache-2.0,
Copyright OpenAI; the version is recorded in the fixture), turned into JSON schema
by pydantic. The SDK's types are lenient on purpose (every optional field is
``Optional[...] = None`` so old servers still parse), so the rules of OpenAI's
published OpenAPI description (openai/openai-openapi, MIT) that the SDK drops are
put back below: which fields are required (present, possibly null) and which may
be absent but never null (arrays and objects). Extra fields stay allowed, as in
the published schema (vLLM's extras such as ``stop_reason`` are legal).

Run ``python tests/entrypoints/schemas/build_openai_schemas.py`` to rebuild it.
"""

from __future__ import annotations

import json
from pathlib import Path

REQUIRED = {
    # (schema, $defs name) -> fields that must be present (nullable ones as null)
    ("chat.completion", "Choice"): ["finish_reason", "index", "message", "logprobs"],
    ("chat.completion", "ChatCompletionMessage"): ["role", "content", "refusal"],
    ("chat.completion", "ChoiceLogprobs"): ["content", "refusal"],
    ("chat.completion", "ChatCompletionTokenLogprob"): [
        "token",
        "logprob",
        "bytes",
        "top_logprobs",
    ],
    ("chat.completion", "TopLogprob"): ["token", "logprob", "bytes"],
    ("chat.completion.chunk", "Choice"): ["delta", "index", "finish_reason"],
    ("chat.completion.chunk", "ChoiceLogprobs"): ["content", "refusal"],
    ("chat.completion.chunk", "ChatCompletionTokenLogprob"): [
        "token",
        "logprob",
        "bytes",
        "top_logprobs",
    ],
    ("chat.completion.chunk", "TopLogprob"): ["token", "logprob", "bytes"],
    ("text_completion", "CompletionChoice"): ["finish_reason", "index", "logprobs", "text"],
    ("text_completion.chunk", "CompletionChoice"): ["finish_reason", "index", "logprobs", "text"],
    ("error", None): ["message", "type", "param", "code"],
}
NOT_NULL = {
    # (schema, $defs name or None for the top level) -> fields that are never null
    ("chat.completion", None): ["usage", "system_fingerprint"],
    ("chat.completion", "Choice"): ["finish_reason"],
    ("chat.completion", "ChatCompletionMessage"): ["tool_calls", "annotations", "function_call"],
    ("chat.completion", "CompletionUsage"): ["completion_tokens_details", "prompt_tokens_details"],
    ("chat.completion.chunk", None): ["system_fingerprint"],
    ("chat.completion.chunk", "ChoiceDelta"): ["tool_calls", "function_call"],
    ("chat.completion.chunk", "ChoiceDeltaToolCall"): ["id", "function", "type"],
    ("chat.completion.chunk", "ChoiceDeltaToolCallFunction"): ["name", "arguments"],
    ("chat.completion.chunk", "CompletionUsage"): [
        "completion_tokens_details",
        "prompt_tokens_details",
    ],
    ("text_completion", None): ["usage", "system_fingerprint"],
    ("text_completion", "CompletionChoice"): ["finish_reason"],
    ("text_completion", "Logprobs"): ["text_offset", "token_logprobs", "tokens", "top_logprobs"],
    ("text_completion", "CompletionUsage"): ["completion_tokens_details", "prompt_tokens_details"],
    ("text_completion.chunk", None): ["system_fingerprint"],
    ("text_completion.chunk", "Logprobs"): [
        "text_offset",
        "token_logprobs",
        "tokens",
        "top_logprobs",
    ],
}
NULLABLE = {
    # A streamed completion's chunks reuse the response object; finish_reason is null
    # until the last chunk of a choice (what OpenAI's API sends).
    ("text_completion.chunk", "CompletionChoice"): ["finish_reason"],
}


def _schemas() -> dict[str, dict]:
    from openai.types import Completion, ErrorObject, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from pydantic import TypeAdapter

    types = {
        "chat.completion": ChatCompletion,
        "chat.completion.chunk": ChatCompletionChunk,
        "text_completion": Completion,
        "text_completion.chunk": Completion,
        "model": Model,
        "error": ErrorObject,
    }
    return {name: TypeAdapter(t).json_schema(mode="serialization") for name, t in types.items()}


def _node(schema: dict, defname: str | None) -> dict:
    return schema if defname is None else schema["$defs"][defname]


def _strip_null(prop: dict) -> None:
    options = prop.get("anyOf")
    if options is None:
        return
    kept = [o for o in options if o.get("type") != "null"]
    prop.pop("default", None)
    if len(kept) == 1:
        prop.pop("anyOf")
        prop.update(kept[0])
    else:
        prop["anyOf"] = kept


def build() -> dict:
    import openai

    schemas = _schemas()
    for (name, defname), fields in REQUIRED.items():
        node = _node(schemas[name], defname)
        node["required"] = sorted(set(node.get("required", [])) | set(fields))
    for (name, defname), fields in NOT_NULL.items():
        node = _node(schemas[name], defname)
        for f in fields:
            _strip_null(node["properties"][f])
    for (name, defname), fields in NULLABLE.items():
        node = _node(schemas[name], defname)
        for f in fields:
            node["properties"][f] = {"anyOf": [node["properties"][f], {"type": "null"}]}
    # The error body wraps the error object.
    schemas["error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": schemas["error"]},
    }
    return {
        "source": f"openai-python {openai.__version__} pydantic types (Apache-2.0), "
        "tightened to OpenAI's published OpenAPI required/nullable rules",
        "schemas": schemas,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("openai_responses.json")
    out.write_text(json.dumps(build(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
