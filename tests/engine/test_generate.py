"""End-to-end behaviour of LLM.generate / chat / generate_stream on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def hf_greedy(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never suppress EOS
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_matches_transformers(tiny_llm, tiny_llama_dir):
    prompt = [5, 17, 300, 4000, 12, 9, 77]
    out = tiny_llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 24)
    assert out.prompt_token_ids == prompt
    assert out.finished and out.outputs[0].finish_reason == "length"


def test_prompt_forms_and_order(tiny_llm):
    outs = tiny_llm.generate(
        ["Hello there", [5, 6, 7], {"prompt": "Hi"}, {"prompt_token_ids": [9, 9]}],
        SamplingParams(temperature=0, max_tokens=3),
    )
    assert [o.prompt for o in outs] == ["Hello there", None, "Hi", None]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert all(len(o.outputs[0].token_ids) <= 3 for o in outs)


def test_text_matches_decoded_tokens(tiny_llm):
    out = tiny_llm.generate("Once upon a time", GREEDY)[0].outputs[0]
    assert out.text == tiny_llm.tokenizer.decode(out.token_ids)


def test_stop_string_truncates_and_reports(tiny_llm):
    full = tiny_llm.generate("abc", GREEDY)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = tiny_llm.generate("abc", params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    params.include_stop_str_in_output = True
    out = tiny_llm.generate("abc", params)[0].outputs[0]
    assert out.text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(tiny_llm):
    ids = tiny_llm.generate("xyz", GREEDY)[0].outputs[0].token_ids
    stop_id = ids[4]
    first = ids.index(stop_id)
    out = tiny_llm.generate(
        "xyz", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    )[0]
    assert out.outputs[0].token_ids == ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    # min_tokens suppresses the stop token until enough tokens are out
    out = tiny_llm.generate(
        "xyz",
        SamplingParams(
            temperature=0, max_tokens=24, min_tokens=first + 2, stop_token_ids=[stop_id]
        ),
    )[0]
    assert len(out.outputs[0].token_ids) >= first + 2


def test_eos_stops_unless_ignored(tiny_llm):
    eos = sorted(tiny_llm.tokenizer.eos_token_ids)[0]
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    out = tiny_llm.generate("hi", params)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    params.ignore_eos = True
    out = tiny_llm.generate("hi", params)[0].outputs[0]
    assert out.token_ids == [eos] * 10 and out.finish_reason == "length"


def test_n_greater_than_one_and_seeds(tiny_llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=123, ignore_eos=True)
    a = tiny_llm.generate("seeded", params)[0]
    b = tiny_llm.generate(["other prompt", "seeded", "x"], params)[1]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # children use different seeds


def test_logprobs_and_prompt_logprobs(tiny_llm):
    params = SamplingParams(
        temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    out = tiny_llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for tok, pos in zip(comp.token_ids, comp.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        assert len(pos) == 3 and isinstance(pos[tok].bytes, bytes)
        top = sorted(pos.values(), key=lambda lp: lp.rank)
        assert all(x.logprob >= y.logprob for x, y in zip(top, top[1:]))
    assert comp.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(comp.token_ids, comp.logprobs))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    for tok, pos in zip([6, 7, 8], out.prompt_logprobs[1:]):
        assert tok in pos and pos[tok].logprob <= 0


def test_stream_deltas_add_up_and_close_cancels(tiny_llm):
    final = tiny_llm.generate("stream me", GREEDY)[0].outputs[0]
    params = GREEDY.clone()
    params.output_kind = RequestOutputKind.DELTA
    deltas = list(tiny_llm.generate_stream("stream me", params))
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final.token_ids
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    stream = tiny_llm.generate_stream("stream me", GREEDY)
    next(stream)
    assert tiny_llm.engine.kv.num_free_blocks < tiny_llm.engine.kv.num_blocks
    stream.close()
    assert tiny_llm.engine.kv.num_free_blocks == tiny_llm.engine.kv.num_blocks


def test_chat_renders_template(tiny_llm):
    msgs = [{"role": "user", "content": "Hi!"}]
    out = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt_token_ids == tiny_llm.tokenizer.apply_chat_template(msgs)
    two = tiny_llm.chat([msgs, msgs], SamplingParams(temperature=0, max_tokens=2))
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"stop_token_ids": "pick"},
        {"stop_token_ids": "pick", "include_stop_str_in_output": True},
        {"skip_special_tokens": False, "logit_bias": "eos"},
    ],
)
def test_final_text_decoded_once_equals_the_streamed_text(tiny_llm, extra):
    """Final-only outputs without stop strings decode their text once at the end: it must be
    the text the incremental detokenizer streams, stop tokens left out alike."""
    base = dict(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "日本語のテキスト", [5, 17, 300, 4000]]
    kwargs = dict(extra)
    if kwargs.get("stop_token_ids") == "pick":
        ids = tiny_llm.generate(prompts[0], SamplingParams(**base))[0].outputs[0].token_ids
        kwargs["stop_token_ids"] = [ids[5]]
    if kwargs.get("logit_bias") == "eos":  # the EOS text itself, when special tokens show
        eos = sorted(tiny_llm.tokenizer.eos_token_ids)[0]
        kwargs.update(logit_bias={eos: 5.0}, ignore_eos=False)
        base.pop("ignore_eos")
    final = SamplingParams(**base, **kwargs)
    streamed = SamplingParams(**base, **kwargs, output_kind=RequestOutputKind.CUMULATIVE)
    for prompt in prompts:
        a = tiny_llm.generate(prompt, final)[0].outputs[0]
        b = [o for o in tiny_llm.generate_stream(prompt, streamed)][-1].outputs[0]
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE])
def test_detokenize_false_gives_token_ids_only(tiny_llm, kind):
    """detokenize=False: the same tokens, no text; a stop token id still stops and is the
    stop_reason."""
    with_text = tiny_llm.generate("Once upon a time", GREEDY)[0].outputs[0]
    stop_id = with_text.token_ids[5]
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, detokenize=False, output_kind=kind
    )
    out = tiny_llm.generate("Once upon a time", params)[0].outputs[0]
    assert out.token_ids == with_text.token_ids and out.text == ""
    params.stop_token_ids = [stop_id]
    out = tiny_llm.generate("Once upon a time", params)[0].outputs[0]
    first = with_text.token_ids.index(stop_id)
    assert out.token_ids == with_text.token_ids[: first + 1] and out.text == ""
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_detokenize_false_rejects_stop_strings():
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["\n"], detokenize=False)
