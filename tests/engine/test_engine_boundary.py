"""What LLMEngine.add_request does with a request on its own (no LLM facade in front)."""

from __future__ import annotations

from tokenmill import SamplingParams


def test_add_request_applies_truncate_prompt_tokens(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3)
    rid = engine.add_request([5, 6, 7, 8, 9], params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None and final.prompt_token_ids == [7, 8, 9]
    plain = tiny_llm.generate(
        {"prompt_token_ids": [7, 8, 9]}, SamplingParams(temperature=0, max_tokens=2)
    )[0]
    assert final.outputs[0].token_ids == plain.outputs[0].token_ids
