"""Gemma3 as an embedding model (EmbeddingGemma): bidirectional attention with its local
window, mean pooling, two Dense layers and Normalize, against transformers and
sentence-transformers. Random tiny weights by default; the real 300M model is slow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM
from tokenmill.pooling import PoolingParams

TEXTS = [
    "hello world",
    "a somewhat longer input with more words in it, long enough to cross the local window",
    "ünïcode ✓",
    "x",
]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def _tiny_gemma(path: Path, minilm_dir: Path, bidirectional: bool) -> torch.nn.Module:
    """A 4-layer random Gemma3TextModel (local window 8: +-4 tokens when bidirectional)
    saved with MiniLM's tokenizer as a sentence-transformers folder: mean pooling,
    Dense 32 -> 48 -> 32 (no bias, identity), Normalize."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=256,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        use_bidirectional_attention=bidirectional,
        pad_token_id=0,
        initializer_range=0.2,
    )
    model = transformers.Gemma3TextModel(cfg).eval()
    with torch.no_grad():  # the (1 + w) norms start at w = 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, path / name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    for folder, (n_in, n_out) in {"2_Dense": (32, 48), "3_Dense": (48, 32)}.items():
        _dense(path / folder, n_in, n_out)
    st_config = {"prompts": PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"}
    (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    return model


def _dense(folder: Path, n_in: int, n_out: int) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    conf = {
        "in_features": n_in,
        "out_features": n_out,
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
    }
    (folder / "config.json").write_text(json.dumps(conf))
    save_file(
        {"linear.weight": torch.randn(n_out, n_in) / n_in**0.5}, str(folder / "model.safetensors")
    )


@pytest.mark.parametrize("bidirectional", [True, False])
def test_hidden_states_match_transformers(tmp_path, minilm_dir, bidirectional):
    ref_model = _tiny_gemma(tmp_path, minilm_dir, bidirectional)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.llm_engine.task == "embed"
    batch = llm.get_tokenizer()(TEXTS, padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[1] > 8  # the long text crosses the local window
    with torch.no_grad():
        ref = ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    tokens = llm.encode(TEXTS, pooling_task="token_embed")
    for i, out in enumerate(tokens):
        n = int(batch["attention_mask"][i].sum())
        torch.testing.assert_close(
            out.outputs.data, ref.last_hidden_state[i, :n], atol=1e-4, rtol=1e-4
        )
    llm.close()


def test_embeddings_match_sentence_transformers(tmp_path, minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    _tiny_gemma(tmp_path, minilm_dir, bidirectional=True)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.llm_engine.embedding_size == 32
    ref_model = st.SentenceTransformer(str(tmp_path), device="cpu")
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    want = ref_model.encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    query = ref_model.encode(TEXTS, prompt_name="query", convert_to_tensor=True)
    mine = llm.embed([PROMPTS["query"] + t for t in TEXTS])
    torch.testing.assert_close(
        torch.tensor([o.outputs.embedding for o in mine]), query, atol=1e-5, rtol=1e-4
    )
    raw = llm.embed(TEXTS[:1], PoolingParams(normalize=False))[0].outputs.embedding
    assert abs(float(torch.tensor(raw).norm()) - 1.0) > 1e-3  # Normalize is the last step
    llm.close()


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "Ich habe heute keine Zeit, aber morgen vielleicht.",
    "東京は日本の首都です。",
    "def add(a, b):\n    return a + b",
    "ok",
    "Embeddings map text to vectors so that similar meanings land close together; "
    "this sentence is long on purpose, repeating itself to span several hundred tokens. " * 12,
    "Past the local window of 256 tokens on either side: " + "one more word " * 250,
]


@pytest.mark.slow
def test_embeddinggemma_matches_sentence_transformers(embeddinggemma_dir):
    st = pytest.importorskip("sentence_transformers")
    ref_model = st.SentenceTransformer(str(embeddinggemma_dir), device="cpu")
    prompts = ref_model.prompts
    llm = LLM(str(embeddinggemma_dir), dtype="float32")
    assert llm.llm_engine.embedding_size == 768
    for name in (None, "query", "document"):
        prefix = prompts[name] if name else ""
        got = torch.tensor(
            [o.outputs.embedding for o in llm.embed([prefix + s for s in SENTENCES])]
        )
        want = ref_model.encode(SENTENCES, prompt_name=name, convert_to_tensor=True)
        cos = F.cosine_similarity(got, want.float(), dim=-1)
        assert cos.min() >= 0.9999, (name, cos.tolist())
    llm.close()


@pytest.mark.parametrize("kind", ["MEAN", "MAX", "CLS", "LAST"])
def test_bfloat16_pooling_of_a_long_sequence(kind):
    """Mixed lengths pool through segment_reduce, which sums in the input dtype: the mean of
    750 bfloat16 rows must be summed in float32 (EmbeddingGemma's long texts in a batch)."""
    from tokenmill.models.bert import PackedBatch
    from tokenmill.pooling.pooler import pool

    torch.manual_seed(0)
    hidden = torch.randn(800, 64) + 3
    batch = PackedBatch.of([750, 50])
    want = pool(hidden, batch, kind)
    got = pool(hidden.bfloat16(), batch, kind)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.02, rtol=0.01)
