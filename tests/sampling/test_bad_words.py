"""SamplingParams.bad_words (vLLM's): the variants' token ids, the row processor, and a
real engine: no variant is ever generated, batched equals one at a time, and only words
of several tokens make the steps synchronous."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling import RowState
from tokenmill.sampling.logits_processors import apply_bad_words


class WordTokenizer:
    """The tokens: " foo" differs from "foo", " bar" is "bar", "a b" is two tokens."""

    table = {"foo": [1], " foo": [2], "a b": [3, 5], " a b": [4, 5], "bar": [6], " bar": [6]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.table[text]


def resolved(words: list[str], vocab_size: int = 16) -> SamplingParams:
    params = SamplingParams(temperature=0.0, bad_words=words)
    params.resolve_bad_words(WordTokenizer(), vocab_size)
    return params


def test_variants_as_vllm_builds_them():
    assert resolved(["foo"]).bad_words_token_ids == [[1], [2]]
    assert resolved([" foo"]).bad_words_token_ids == [[1], [2]]  # leading space stripped
    assert resolved(["a b"]).bad_words_token_ids == [[3, 5], [4, 5]]
    assert resolved(["bar"]).bad_words_token_ids == [[6]]  # the spaced one is the same token
    params = resolved(["foo"])
    params.resolve_bad_words(WordTokenizer(), 16)  # idempotent
    assert params.bad_words_token_ids == [[1], [2]]
    with pytest.raises(InvalidRequestError, match="bad_words token id 6 is out of range"):
        resolved(["bar"], vocab_size=4)
    for bad in ([""], ["  "], [3]):
        with pytest.raises(InvalidRequestError, match="bad_words must contain only non-empty"):
            SamplingParams(bad_words=bad)


def test_only_words_of_several_tokens_read_the_history():
    assert not SamplingParams().reads_output_tokens
    assert SamplingParams(bad_words=["foo"]).reads_output_tokens  # unresolved: the worst
    assert not resolved(["foo"]).reads_output_tokens
    assert resolved(["foo", "a b"]).reads_output_tokens


def test_processor_bans_the_last_token_after_a_matching_prefix():
    params = resolved(["foo", "a b"])
    rows = [
        RowState(params, [0], [], None, frozenset()),  # no history: only one-token words
        RowState(params, [0], [7, 3], None, frozenset()),  # "a" came last: " b" banned
        RowState(params, [3], [4, 7], None, frozenset()),  # " a" not last (the prompt's "a"
        RowState(SamplingParams(), [0], [3], None, frozenset()),  # does not count either)
    ]
    logits = torch.zeros(4, 16)
    apply_bad_words(logits, rows)
    banned = [set(torch.nonzero(torch.isinf(r)).flatten().tolist()) for r in logits]
    assert banned == [{1, 2}, {1, 2, 5}, {1, 2}, set()]


# ---- a real engine -----------------------------------------------------------------

PROMPTS = [[(11 * i + j) % 3000 + 20 for j in range(3 + (i * 7) % 13)] for i in range(6)]


def make(model_dir, mode: str = "off") -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=128,
               block_size=4, async_scheduling=mode, check_kv_integrity=True)  # fmt: skip


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def contains(seq: list[int], word: list[int]) -> bool:
    return any(seq[i : i + len(word)] == word for i in range(len(seq) - len(word) + 1))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with make(tiny_llama_dir) as engine:
        yield engine


@pytest.fixture(scope="module")
def words(llm):
    """Bad words cut from the plain greedy answers, one of one token and one of two, whose
    variants name the tokens they were cut from."""
    plain = generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tok, vocab = llm.get_tokenizer(), llm.engine.vocab_size
    found: dict[int, str] = {}
    for seq in plain:
        for width in (1, 2):
            for i in range(len(seq) - width + 1):
                text = tok.decode(seq[i : i + width])
                params = SamplingParams(bad_words=[text])
                params.resolve_bad_words(tok, vocab)
                if seq[i : i + width] in params.bad_words_token_ids:
                    found.setdefault(width, text)
    if len(found) < 2:
        pytest.skip(f"no usable words of one and two tokens in the greedy answers: {found}")
    return plain, [found[1]], [found[2]]


def test_banned_words_never_appear_and_batched_equals_single(llm, words):
    plain, one, two = words
    for bad in (one, two, one + two):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=bad)
        batched = generate(llm, PROMPTS, params)
        single = [generate(llm, [p], params)[0] for p in PROMPTS]
        assert batched == single
        params.resolve_bad_words(llm.get_tokenizer(), llm.engine.vocab_size)
        for seq in batched:
            assert not any(contains(seq, w) for w in params.bad_words_token_ids), (bad, seq)
        assert batched != plain  # the words were in the plain answers


def test_async_scheduling_matches_sync_and_syncs_only_for_long_words(
    tiny_llama_dir, llm, words, monkeypatch
):
    _, one, two = words
    with make(tiny_llama_dir, "on") as overlapped:
        assert overlapped.engine.overlap
        runner = overlapped.engine.runner
        real = runner._pending_tokens
        pending: list[int] = []

        def spy(seqs, cols=None):
            got = real(seqs, cols)
            pending.append(0 if got is None else len(got.seqs))
            return got

        monkeypatch.setattr(runner, "_pending_tokens", spy)
        for bad, overlaps in ((one, True), (two, False)):
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=bad)
            pending.clear()
            assert generate(overlapped, PROMPTS, params) == generate(llm, PROMPTS, params)
            assert (sum(pending) > 0) is overlaps, (bad, pending)
