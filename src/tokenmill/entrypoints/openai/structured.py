"""Request fields -> the structured-output guide and the tool-call setup of a request.

One guide per request, from exactly one of: OpenAI ``response_format``, vLLM's
``structured_outputs``, the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, or ``tool_choice`` required / named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest
from tokenmill.errors import InvalidRequestError
from tokenmill.parsers.tools import ToolParser, resolve_tool_parser
from tokenmill.parsers.tools.forced import (
    NamedToolParser,
    RequiredToolParser,
    forced_guide,
)
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.tokenizer import chat

_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def guide_of(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The guide the request's own fields ask for (tool_choice aside); 400 on conflicts."""
    sources: dict[str, StructuredOutputsParams] = {}
    try:
        fmt = _response_format(req.response_format)
        if fmt is not None:
            sources["response_format"] = fmt
        if req.structured_outputs is not None:
            sources["structured_outputs"] = StructuredOutputsParams.from_dict(
                req.structured_outputs
            )
        guided = {
            mode: getattr(req, name)
            for name, mode in _GUIDED_FIELDS.items()
            if getattr(req, name) is not None
        }
        if guided:
            sources[", ".join(f"guided_{m}" for m in guided)] = StructuredOutputsParams(
                **guided, whitespace_pattern=req.guided_whitespace_pattern
            )
    except InvalidRequestError as e:
        raise bad_request(str(e), "response_format") from e
    sources = {k: v for k, v in sources.items() if not v.is_empty}
    if len(sources) > 1:
        raise bad_request(
            f"the request asks for structured output twice ({' and '.join(sources)});"
            " use one of them",
            "response_format",
        )
    return next(iter(sources.values()), None)


def _response_format(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'
            )
        # OpenAI's strict mode: objects have exactly their listed properties
        return StructuredOutputsParams(
            json=schema, disable_additional_properties=spec.get("strict") is True
        )
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag={k: v for k, v in fmt.items() if k != "type"})
    raise InvalidRequestError(
        f"response_format type {kind!r} is not supported; use text, "
        "json_object, json_schema or structural_tag"
    )


@dataclass(frozen=True)
class ToolSetup:
    """How one chat request treats tools."""

    guide: StructuredOutputsParams | None
    """The grammar that forces the call (required / named), else the request's own guide."""
    parser: ToolParser | None
    """Reads the calls back from the answer (None: tools are off, the answer is content)."""


def tool_setup(
    req: ChatCompletionRequest, parser_name: str | None, chat_template: str | None
) -> ToolSetup:
    """Checks ``tools`` and ``tool_choice`` and picks the guide and the parser."""
    guide = guide_of(req)
    tools = _check_tools(req.tools)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none" or (choice == "auto" and not tools):
        return ToolSetup(guide, None)
    if not tools:
        raise bad_request(f"tool_choice {_show(choice)} needs tools", "tool_choice")
    if choice == "auto":
        return ToolSetup(guide, resolve_tool_parser(parser_name, chat_template)(tools))
    if guide is not None:
        raise bad_request(
            f"tool_choice {_show(choice)} forces a tool call: it can not be "
            "combined with response_format or structured_outputs",
            "tool_choice",
        )
    if choice == "required":
        return ToolSetup(
            forced_guide(tools, "required", req.parallel_tool_calls), RequiredToolParser(tools)
        )
    name = _named(choice, tools)
    return ToolSetup(
        forced_guide(tools, choice, req.parallel_tool_calls), NamedToolParser(tools, name)
    )


def _check_tools(tools: Sequence[Any] | None) -> list[dict]:
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": '
                '..., "parameters": {...}}}}',
                "tools",
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function has no name", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema object", "tools"
            )
    return list(tools or [])


def _named(choice: Any, tools: list[dict]) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": '
            '"function", "function": {"name": ...}}',
            "tool_choice",
        )
    declared = [t["function"]["name"] for t in tools]
    if name not in declared:
        raise bad_request(
            f"tool_choice names {name!r}, which is not among the tools {declared}", "tool_choice"
        )
    return name


def _show(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else "(a named function)"


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs, plus reasoning_effort (templates read it, e.g. gpt-oss)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs


def with_tool_arguments(message: Any) -> Any:
    """``tokenizer.chat.with_tool_arguments``, its error as a 400 on ``messages``."""
    try:
        return chat.with_tool_arguments(message)
    except InvalidRequestError as e:
        raise bad_request(str(e), "messages") from e


def keeps_special_tokens(tokenizer, reasoning, tools: ToolParser | None) -> bool:
    """Whether a parser's markers are special tokens (then the text must keep them)."""
    markers = list(tools.special_markers if tools else ())
    if reasoning is not None:
        markers += [reasoning.start, reasoning.end]
    decoder = getattr(tokenizer.hf, "added_tokens_decoder", {}) or {}
    special = {t.content for t in decoder.values() if getattr(t, "special", False)}
    return any(m in special for m in markers)
