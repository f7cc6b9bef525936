"""all-MiniLM-L6-v2 (real weights) through llm.embed against sentence-transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM
from tokenmill.errors import ContextLengthError, InvalidRequestError
from tokenmill.pooling import EmbeddingRequestOutput, PoolingParams

SENTENCES = [
    "Hello world",
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, twice, before breakfast on a Sunday.",
    "Ünïcödé façade — naïve café 日本語のテキスト Привет мир ✓",
    "x",
    "Long text about rivers and mountains and the sea. " * 12,  # ~130 tokens
]
LONG = "An extremely long sentence that goes on and on about nothing in particular. " * 40


def _cos(ours: list[list[float]], ref) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(ours), torch.as_tensor(ref), dim=-1)


def test_embed_matches_sentence_transformers(minilm, sentence_transformer):
    outs = minilm.embed(SENTENCES)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outs)
    ref = sentence_transformer.encode(SENTENCES, convert_to_tensor=True)
    cos = _cos([o.outputs.embedding for o in outs], ref)
    assert cos.min() >= 0.99999, cos
    assert outs[0].outputs.hidden_size == 384
    assert outs[0].prompt_token_ids == sentence_transformer.tokenizer("Hello world")["input_ids"]


def test_each_sentence_alone_equals_the_batch(minilm):
    batch = [o.outputs.embedding for o in minilm.embed(SENTENCES)]
    alone = [minilm.embed(s)[0].outputs.embedding for s in SENTENCES]
    assert _cos(batch, alone).min() >= 0.999999


def test_truncated_matches_sentence_transformers(minilm, sentence_transformer):
    # sentence-transformers cuts at max_seq_length (256); ours only when asked to.
    with pytest.raises(ContextLengthError, match="truncate_prompt_tokens"):
        minilm.embed(LONG)
    out = minilm.embed(LONG, truncate_prompt_tokens=-1)[0]
    assert len(out.prompt_token_ids) == 256
    ref = sentence_transformer.encode([LONG], convert_to_tensor=True)
    assert _cos([out.outputs.embedding], ref).min() >= 0.99999
    short = minilm.embed(LONG, PoolingParams(truncate_prompt_tokens=10))[0]
    assert len(short.prompt_token_ids) == 10 and short.prompt_token_ids[-1] == 102  # [SEP] kept


def test_token_ids_and_dicts(minilm):
    ids = minilm.embed("A man is eating food.")[0].prompt_token_ids
    by_ids = minilm.embed([ids, {"prompt_token_ids": ids}, {"prompt": "A man is eating food."}])
    vecs = [o.outputs.embedding for o in by_ids]
    assert _cos(vecs, [vecs[0]] * 3).min() >= 0.999999


def test_normalize_and_metadata(minilm):
    # modules.json lists 2_Normalize, which the package lacks: loaded with a warning
    vec = torch.tensor(minilm.embed("hi")[0].outputs.embedding)
    assert vec.norm().item() == pytest.approx(1.0, abs=1e-5)
    raw = torch.tensor(minilm.embed("hi", PoolingParams(normalize=False))[0].outputs.embedding)
    assert raw.norm().item() != pytest.approx(1.0, abs=1e-3)
    assert minilm.llm_engine.plan.pooler.pooling_type == "MEAN"
    assert minilm.llm_engine.max_model_len == 256


def test_score_is_cosine(minilm):
    a, b = minilm.embed(["A man is eating food.", "A man eats."])
    want = F.cosine_similarity(
        torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding), 0
    )
    [one] = minilm.score("A man is eating food.", "A man eats.")
    assert one.outputs.score == pytest.approx(want.item(), abs=1e-5)
    many = minilm.score("A man is eating food.", ["A man eats.", "The sky is blue."])
    assert [s.outputs.score for s in many][0] == pytest.approx(want.item(), abs=1e-5)
    n_to_n = minilm.score(["a", "b"], ["a", "c"])
    assert n_to_n[0].outputs.score == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.embed([]), "empty"),
        (lambda m: m.embed(""), "empty string"),
        (lambda m: m.embed("hi", PoolingParams(dimensions=8)), "Matryoshka"),
        (lambda m: m.score(["a", "b"], ["a", "b", "c"]), "1 -> 1, 1 -> N or N -> N"),
        (lambda m: m.score([], ["a"]), "empty"),
        (lambda m: m.classify("hi"), "does not support the 'classify' task"),
        (lambda m: m.generate("hi"), "pooling model"),
        (lambda m: m.encode("hi", pooling_task="nope"), "unknown"),
        (lambda m: m.embed([[999999]]), "token ids must be in"),
    ],
)
def test_bad_input_is_a_clear_error(minilm, call, match):
    with pytest.raises(InvalidRequestError, match=match):
        call(minilm)
    assert minilm.embed("still works")[0].outputs.hidden_size == 384


def test_matryoshka_when_declared(minilm_dir):
    llm = LLM(str(minilm_dir), pooler_config={"dimensions": 64})
    out = llm.embed("hi")[0].outputs.embedding
    assert len(out) == 64
    assert len(llm.embed("hi", PoolingParams(dimensions=32))[0].outputs.embedding) == 32
    with pytest.raises(InvalidRequestError, match="exceeds"):
        llm.embed("hi", PoolingParams(dimensions=1000))


def test_encode_token_embed(minilm):
    [out] = minilm.encode("Hello world", pooling_task="token_embed")
    assert tuple(out.outputs.data.shape) == (4, 384)


def test_bfloat16_fast_path_stays_close(minilm_dir, sentence_transformer):
    llm = LLM(str(minilm_dir), dtype="bfloat16")
    outs = llm.embed([*SENTENCES, LONG], truncate_prompt_tokens=-1)
    ref = sentence_transformer.encode([*SENTENCES, LONG], convert_to_tensor=True)
    assert _cos([o.outputs.embedding for o in outs], ref).min() >= 0.999
