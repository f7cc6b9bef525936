"""Chat templates: ChatML of SmolLM2, BOS exactly once, clear errors for bad input."""

from __future__ import annotations

import pytest

from tokenmill.errors import InvalidRequestError

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
HI = [{"role": "user", "content": "Hi"}]


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def test_smollm2_chatml_with_default_system_prompt(smollm2_tok):
    ids = smollm2_tok.apply_chat_template(HI)
    expected = (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _text(smollm2_tok, ids) == expected
    assert ids == smollm2_tok.encode(expected, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> is one special token each time


def test_smollm2_matches_transformers_rendering(smollm2_tok, smollm2_hf_tokenizer):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "naïve 🤗?"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Again"},
    ]
    text = smollm2_hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert SMOL_SYSTEM not in text
    assert smollm2_tok.apply_chat_template(conversation) == smollm2_hf_tokenizer.encode(
        text, add_special_tokens=False
    )


def test_generation_prompt_and_continue_final_message(smollm2_tok):
    no_prompt = _text(smollm2_tok, smollm2_tok.apply_chat_template(HI, add_generation_prompt=False))
    assert no_prompt.endswith("Hi<|im_end|>\n")
    partial = HI + [{"role": "assistant", "content": "Hello, I am"}]
    cont = smollm2_tok.apply_chat_template(
        partial, add_generation_prompt=False, continue_final_message=True
    )
    assert _text(smollm2_tok, cont).endswith("<|im_start|>assistant\nHello, I am")
    with pytest.raises(InvalidRequestError, match="add_generation_prompt=False"):
        smollm2_tok.apply_chat_template(partial, continue_final_message=True)


def test_no_template_is_a_clear_error(tiny_tok):
    with pytest.raises(InvalidRequestError, match="no chat template.*chat_template="):
        tiny_tok.apply_chat_template(HI)


def test_explicit_template_adds_bos_once(tiny_tok):
    plain = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    ids = tiny_tok.apply_chat_template(HI, chat_template=plain)
    assert ids[0] == tiny_tok.bos_token_id and ids.count(tiny_tok.bos_token_id) == 1
    with_bos = tiny_tok.apply_chat_template(HI, chat_template="{{ bos_token }}" + plain)
    assert with_bos[0] == tiny_tok.bos_token_id and with_bos.count(tiny_tok.bos_token_id) == 1


def test_tools_and_kwargs_reach_the_template(smollm2_tok):
    template = "{{ tools[0]['name'] }}/{{ flavor }}:{{ messages[0]['content'] }}"
    ids = smollm2_tok.apply_chat_template(
        HI, chat_template=template, tools=[{"name": "get_weather"}], flavor="x"
    )
    assert _text(smollm2_tok, ids) == "get_weather/x:Hi"


def test_template_exception_becomes_invalid_request(smollm2_tok):
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        smollm2_tok.apply_chat_template(HI, chat_template=template)


@pytest.mark.parametrize(
    ("conversation", "message"),
    [
        ("Hi", "must be a list"),
        ([], "messages is empty"),
        (["Hi"], r"messages\[0\] is a str"),
        ([{"content": "Hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] is a int"),
        ([{"role": "user", "content": ["Hi"]}], r"messages\[0\]\['content'\]\[0\] must be a dict"),
    ],
)
def test_malformed_messages(smollm2_tok, conversation, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        smollm2_tok.apply_chat_template(conversation)
    assert isinstance(info.value, ValueError)


def test_assistant_tool_call_without_content_is_accepted(smollm2_tok):
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    conversation = HI + [{"role": "assistant", "content": None, "tool_calls": calls}]
    template = "{% for m in messages %}{{ m['role'] }};{% endfor %}"
    ids = smollm2_tok.apply_chat_template(conversation, chat_template=template)
    assert _text(smollm2_tok, ids) == "user;assistant;"


CALL_TEMPLATE = (
    "{% for m in messages %}{% for c in m.tool_calls or [] %}"
    "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% endfor %}"
)


def test_tool_call_arguments_reach_the_template_as_objects(tiny_llm):
    """OpenAI sends arguments as JSON text; templates print them with tojson (LLM.chat)."""
    from tokenmill import SamplingParams

    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    conversation = HI + [{"role": "assistant", "content": None, "tool_calls": calls}]
    out = tiny_llm.chat(
        conversation,
        SamplingParams(max_tokens=1),
        chat_template=CALL_TEMPLATE,
        add_generation_prompt=False,
    )[0]
    assert _text(tiny_llm.tokenizer, out.prompt_token_ids).endswith('add{"a": 1}')
    calls[0]["function"]["arguments"] = "{not json"
    with pytest.raises(InvalidRequestError, match="arguments are not JSON"):
        tiny_llm.chat(conversation, SamplingParams(max_tokens=1), chat_template=CALL_TEMPLATE)
