"""``LLM(whisper_folder)``: ``transcribe`` and vLLM's ``generate`` with audio prompts give
what the ``Transcriber`` gives; text prompts, chat and a Piper voice are clear errors."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError


@pytest.fixture(scope="module")
def whisper_llm(whisper_ct2):
    with LLM(str(whisper_ct2)) as llm:
        yield llm


def test_transcribe_and_generate_match_the_transcriber(whisper_llm, transcriber, clips):
    want = [transcriber.transcribe(c, language="en").text for c in clips[:2]]
    assert [whisper_llm.transcribe(c, language="en").text for c in clips[:2]] == want
    prompts = [
        {"prompt": "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>",
         "multi_modal_data": {"audio": c}}
        for c in clips[:2]
    ]  # fmt: skip
    outs = whisper_llm.generate(prompts, SamplingParams(temperature=0))
    assert [o.outputs[0].text for o in outs] == want
    assert all(o.finished and o.outputs[0].token_ids for o in outs)


def test_wrong_inputs_say_what_to_pass(whisper_llm, piper_voice):
    with pytest.raises(InvalidRequestError, match="multi_modal_data"):
        whisper_llm.generate("hello")
    with pytest.raises(InvalidRequestError, match="Whisper model"):
        whisper_llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="text-to-speech"):
        LLM(str(piper_voice))
