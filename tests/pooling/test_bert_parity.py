"""Random-weight BERT / RoBERTa encoders and classifiers against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from encoder_models import make_encoder

from tokenmill import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.pooling import PoolingParams

TEXTS = ["hello world", "a somewhat longer input with more words in it", "ünïcode ✓", "x y z"]


def _hf_inputs(llm: LLM, texts, pairs=None):
    tok = llm.get_tokenizer()
    return tok(texts, pairs, padding=True, return_tensors="pt")


@pytest.mark.parametrize("arch", ["BertModel", "RobertaModel"])
def test_encoder_hidden_states_and_cls(tmp_path, minilm_dir, arch):
    import transformers

    path = make_encoder(
        tmp_path / arch, minilm_dir, arch, pad_token_id=1 if "Roberta" in arch else 0
    )
    llm = LLM(str(path))
    assert llm.llm_engine.task == "embed"
    ref_model = getattr(transformers, arch).from_pretrained(path).eval()
    batch = _hf_inputs(llm, TEXTS)
    if arch == "RobertaModel":
        batch.pop("token_type_ids")
    with torch.no_grad():
        ref = ref_model(**batch).last_hidden_state
    cls = [o.outputs.embedding for o in llm.embed(TEXTS, PoolingParams(normalize=False))]
    assert torch.allclose(torch.tensor(cls), ref[:, 0], atol=1e-4)
    tokens = llm.encode(TEXTS, pooling_task="token_embed")
    for i, out in enumerate(tokens):
        n = int(batch["attention_mask"][i].sum())
        assert torch.allclose(out.outputs.data, ref[i, :n], atol=1e-4)
    normed = torch.tensor(llm.embed(TEXTS)[0].outputs.embedding)  # vLLM's default: normalized
    assert torch.allclose(normed, F.normalize(ref[0, 0], dim=0), atol=1e-5)


def test_pooler_config_override(tmp_path, minilm_dir):
    path = make_encoder(tmp_path / "m", minilm_dir, "BertModel")
    mean = LLM(str(path), pooler_config={"pooling_type": "mean", "normalize": False})
    tokens = mean.encode(TEXTS, pooling_task="token_embed")
    want = torch.stack([t.outputs.data.mean(0) for t in tokens])
    got = torch.tensor([o.outputs.embedding for o in mean.embed(TEXTS)])
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(InvalidRequestError, match="pooler_config keys"):
        LLM(str(path), pooler_config={"bogus": 1})


@pytest.mark.parametrize(
    "arch", ["BertForSequenceClassification", "RobertaForSequenceClassification"]
)
def test_classifier_probs(tmp_path, minilm_dir, arch):
    import transformers

    path = make_encoder(
        tmp_path / arch, minilm_dir, arch, num_labels=3, pad_token_id=1 if "Roberta" in arch else 0
    )
    llm = LLM(str(path))
    assert llm.llm_engine.task == "classify"
    ref_model = getattr(transformers, arch).from_pretrained(path).eval()
    batch = _hf_inputs(llm, TEXTS)
    if "Roberta" in arch:
        batch.pop("token_type_ids")
    with torch.no_grad():
        logits = ref_model(**batch).logits
    outs = llm.classify(TEXTS)
    assert outs[0].outputs.num_classes == 3
    assert torch.allclose(
        torch.tensor([o.outputs.probs for o in outs]), logits.softmax(-1), atol=1e-5
    )
    raw = llm.classify(TEXTS, PoolingParams(activation=False))
    assert torch.allclose(torch.tensor([o.outputs.probs for o in raw]), logits, atol=1e-4)
    with pytest.raises(InvalidRequestError, match="does not support the 'score' task"):
        llm.score("a", "b")
    with pytest.raises(InvalidRequestError, match="does not support the 'embed' task"):
        llm.embed("a")


def test_cross_encoder_score_and_rerank_order(tmp_path, minilm_dir):
    import transformers

    path = make_encoder(tmp_path / "ce", minilm_dir, "BertForSequenceClassification", num_labels=1)
    llm = LLM(str(path))
    assert llm.llm_engine.task == "score"
    ref_model = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    query = "what is the capital of france"
    docs = ["paris is the capital", "bananas are yellow", "france is in europe", "x"]
    batch = _hf_inputs(llm, [query] * len(docs), docs)  # with segment ids
    with torch.no_grad():
        ref = torch.sigmoid(ref_model(**batch).logits[:, 0])
    outs = llm.score(query, docs)
    got = torch.tensor([o.outputs.score for o in outs])
    assert torch.allclose(got, ref, atol=1e-5)
    assert got.argsort(descending=True).tolist() == ref.argsort(descending=True).tolist()
    assert (
        outs[0].prompt_token_ids == batch["input_ids"][0][batch["attention_mask"][0] == 1].tolist()
    )


def test_runner_options(tmp_path, minilm_dir):
    path = make_encoder(tmp_path / "m", minilm_dir, "BertModel")
    with pytest.raises(InvalidRequestError, match="runner="):
        LLM(str(path), runner="bogus")
    with pytest.raises(ValueError, match="classifier head"):
        LLM(str(path), convert="classify")


@pytest.mark.parametrize("arch", ["ModernBertModel", "ModernBertForSequenceClassification"])
def test_modernbert(tmp_path, minilm_dir, arch):
    import shutil

    import transformers

    torch.manual_seed(0)
    cfg = transformers.ModernBertConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=256,
        local_attention=8,  # windows of +-4 tokens: the long texts cross them
        global_attn_every_n_layers=2,
        pad_token_id=0,
        bos_token_id=101,
        eos_token_id=102,
        cls_token_id=101,
        sep_token_id=102,
        num_labels=3,
        initializer_range=0.2,
    )
    ref_model = getattr(transformers, arch)(cfg).eval()
    ref_model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, tmp_path / name)
    llm = LLM(str(tmp_path))
    texts = [*TEXTS, "a long text with many words to cross the local attention window " * 2]
    batch = _hf_inputs(llm, texts)
    batch.pop("token_type_ids", None)
    with torch.no_grad():
        ref = ref_model(**batch)
    if arch == "ModernBertModel":
        tokens = llm.encode(texts, pooling_task="token_embed")
        for i, out in enumerate(tokens):
            n = int(batch["attention_mask"][i].sum())
            assert torch.allclose(out.outputs.data, ref.last_hidden_state[i, :n], atol=1e-4)
    else:
        got = torch.tensor([o.outputs.probs for o in llm.classify(texts)])
        assert torch.allclose(got, ref.logits.softmax(-1), atol=1e-5)
