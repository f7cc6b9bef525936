"""Decoders as pooling models: a random Qwen3 embedding model (last token) and a yes/no
reranker, against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM
from tokenmill.errors import UnsupportedModelError

TEXTS = ["hello world", "a somewhat longer input with more words in it", "x"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, smollm2_hf_tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(smollm2_hf_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    path = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    smollm2_hf_tokenizer.save_pretrained(path)
    return path


def _reference(path, texts):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            res = model(ids, output_hidden_states=True)
        out.append((res.hidden_states[-1][0, -1], res.logits[0, -1]))
    return tok, out


def test_last_token_embedding_matches_transformers(qwen3_dir):
    llm = LLM(str(qwen3_dir), runner="pooling")
    assert llm.llm_engine.plan.causal and llm.llm_engine.plan.pooler.pooling_type == "LAST"
    _, ref = _reference(qwen3_dir, TEXTS)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    want = F.normalize(torch.stack([h for h, _ in ref]), dim=-1)
    assert torch.allclose(got, want, atol=1e-4)
    assert LLM(str(qwen3_dir)).llm_engine.__class__.__name__ == "LLMEngine"  # auto: generate


def test_yes_no_reranker_matches_transformers(qwen3_dir):
    tokens = ["no", "yes"]
    llm = LLM(
        str(qwen3_dir),
        runner="pooling",
        convert="classify",
        pooler_config={"classifier_from_token": tokens},
    )
    assert llm.llm_engine.task == "score"
    query, docs = "what is the capital", ["paris is", "bananas", "the capital of france is paris"]
    tok, ref = _reference(qwen3_dir, [query + d for d in docs])
    no, yes = tok.convert_tokens_to_ids(tokens)
    want = torch.tensor([torch.sigmoid(lg[yes] - lg[no]).item() for _, lg in ref])
    got = torch.tensor([s.outputs.score for s in llm.score(query, docs)])
    assert torch.allclose(got, want, atol=1e-5)
    assert got.argsort().tolist() == want.argsort().tolist()
    with pytest.raises(UnsupportedModelError, match="classifier_from_token"):
        LLM(str(qwen3_dir), runner="pooling", convert="classify")
