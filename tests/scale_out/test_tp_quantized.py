"""Quantized GGUF weights split along their blocks: 2 ranks give the one-process tokens."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_synth import synthetic_tensors, write_gguf

from tokenmill import LLM, SamplingParams
from tokenmill.inputs import TokensPrompt

PROMPTS = [TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9]), TokensPrompt(prompt_token_ids=[40, 3])]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, smollm2_hf_tokenizer):
    path = tmp_path_factory.mktemp("tok")
    smollm2_hf_tokenizer.save_pretrained(path)
    return path


def _tokens(path, tokenizer_dir, **options):
    with LLM(str(path), tokenizer=str(tokenizer_dir), num_kv_blocks=32, **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("types", [[Q.Q4_0, Q.Q8_0], [Q.Q4_1, Q.Q8_0]], ids=["q4_0", "q4_1"])
def test_quantized_tp2_equals_tp1(types, tmp_path, tokenizer_dir):
    path = write_gguf(tmp_path / "m.gguf", synthetic_tensors(types))
    ref = _tokens(path, tokenizer_dir)
    assert _tokens(path, tokenizer_dir, tensor_parallel_size=2) == ref


def test_blocks_wider_than_a_shard_are_refused(tmp_path, tokenizer_dir):
    # Q4_K blocks hold 256 columns; each rank's o_proj input is 128 columns
    path = write_gguf(tmp_path / "k.gguf", synthetic_tensors([Q.Q4_K]))
    with pytest.raises(Exception, match="Q4_K tensor .* column shards of 128"):
        _tokens(path, tokenizer_dir, tensor_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "float32"], ids=["q4_1_kept", "dequantized"])
def test_smollm2_tp3_equals_tp1(smollm2_gguf, dtype):
    # 9 query heads, 3 KV heads, MLP 1536: 3 ranks split them (2 can not, test_tp_failures)
    chat = [[{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Write a haiku about rain."}]]  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=16)

    def tokens(**options):
        with LLM(str(smollm2_gguf), max_model_len=256, dtype=dtype, **options) as llm:
            return [o.outputs[0].token_ids for o in llm.chat(chat, greedy, use_tqdm=False)]

    assert tokens(tensor_parallel_size=3) == tokens()
