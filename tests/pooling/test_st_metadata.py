"""sentence-transformers folders with Dense layers, max pooling and prompts: read from the
folder's own files, checked against sentence-transformers loading the same folder."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from encoder_models import make_encoder

from tokenmill import LLM

TEXTS = ["hello world", "a somewhat longer input with more words in it", "ünïcode ✓"]


@pytest.mark.parametrize("mode", ["mean", "max", "cls"])
def test_dense_layers_pooling_modes_and_normalize(tmp_path, minilm_dir, mode):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

    encoder = make_encoder(tmp_path / "enc", minilm_dir, "BertModel")
    torch.manual_seed(1)
    modules = [
        Transformer(str(encoder)),
        Pooling(32, pooling_mode=mode),
        Dense(32, 16, activation_function=torch.nn.Tanh()),
        Dense(16, 8),
        Normalize(),
    ]
    folder = tmp_path / "st"
    st.SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    ref = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = LLM(str(folder))
    assert llm.llm_engine.plan.pooler.pooling_type == mode.upper()
    assert len(llm.llm_engine.plan.pooler.dense) == 2
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert got.shape == (3, 8)
    assert F.cosine_similarity(got, ref, dim=-1).min() >= 0.99999


def test_default_prompt_is_prefixed(tmp_path, minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.models import Pooling, Transformer

    encoder = make_encoder(tmp_path / "enc", minilm_dir, "BertModel")
    folder = tmp_path / "st"
    model = st.SentenceTransformer(
        modules=[Transformer(str(encoder)), Pooling(32, pooling_mode="mean")], device="cpu"
    )
    model.save(str(folder))
    conf = json.loads((folder / "config_sentence_transformers.json").read_text())
    conf.update(prompts={"query": "query: ", "document": ""}, default_prompt_name="query")
    (folder / "config_sentence_transformers.json").write_text(json.dumps(conf))
    ref = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = LLM(str(folder))
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert F.cosine_similarity(got, ref, dim=-1).min() >= 0.99999
    tok = llm.get_tokenizer()
    assert llm.embed("hi")[0].prompt_token_ids == tok("query: hi")["input_ids"]
