"""instructor and LangChain (langchain-openai) against a live server on the default model
(SmolLM2-135M-Instruct), unchanged: structured output through tools and JSON schemas.
A small model answers badly, but the answer must parse into the asked-for type."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator

import pytest
from pydantic import BaseModel, Field

from tokenmill import LLM
from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

openai = pytest.importorskip("openai")
SMOL = "smol"


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Count(BaseModel):
    """How many legs an animal has."""

    legs: int = Field(ge=0, le=100)


ASK_CITY = "Name the capital of France and its country, as JSON."
ASK_LEGS = "How many legs does a dog have?"


@pytest.fixture(scope="module")
def smol_url(smollm2_gguf) -> Iterator[str]:
    llm = LLM(dtype="float32", max_model_len=1024, served_model_name=SMOL)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    yield srv.url + "/v1"
    srv.close(timeout=30)
    llm.close()


def _library(module: str, package: str):
    """The library, or a skip only when it is not installed at all (a broken install of it
    fails: the test extra and the Makefile install both)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} is not installed (make setup installs it)")
    return importlib.import_module(module)


# ---- instructor ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(smol_url, mode):
    instructor = _library("instructor", "instructor")
    raw = openai.OpenAI(base_url=smol_url, api_key="unused", max_retries=0, timeout=120)
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    for model, ask in ((City, ASK_CITY), (Count, ASK_LEGS)):
        got = client.chat.completions.create(
            model=SMOL,
            response_model=model,
            messages=[{"role": "user", "content": ask}],
            max_tokens=80,
            temperature=0,
            max_retries=0,
        )
        assert isinstance(got, model)


# ---- LangChain ----------------------------------------------------------------------------


def _chat_model(url: str):
    lc = _library("langchain_openai", "langchain-openai")
    return lc.ChatOpenAI(
        base_url=url, api_key="unused", model=SMOL, temperature=0, max_tokens=80, max_retries=0
    )


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(smol_url, method):
    chat = _chat_model(smol_url)
    for model, ask in ((City, ASK_CITY), (Count, ASK_LEGS)):
        got = chat.with_structured_output(model, method=method).invoke(ask)
        assert isinstance(got, model)


def test_langchain_bind_tools_with_a_named_tool(smol_url):
    chat = _chat_model(smol_url)
    reply = chat.bind_tools([Count], tool_choice="Count").invoke(ASK_LEGS)
    [call] = reply.tool_calls
    assert call["name"] == "Count"
    Count.model_validate(call["args"])
    streamed = list(chat.bind_tools([Count], tool_choice="Count").stream(ASK_LEGS))
    merged = streamed[0]
    for chunk in streamed[1:]:
        merged = merged + chunk
    assert merged.tool_calls[0]["args"] == call["args"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_over_the_responses_api(smol_url, method):
    lc = _library("langchain_openai", "langchain-openai")
    chat = lc.ChatOpenAI(
        base_url=smol_url, api_key="unused", model=SMOL, temperature=0, max_tokens=80,
        max_retries=0, use_responses_api=True,
    )  # fmt: skip
    got = chat.with_structured_output(Count, method=method).invoke(ASK_LEGS)
    assert isinstance(got, Count)
    assert chat.invoke("Say hi").text
