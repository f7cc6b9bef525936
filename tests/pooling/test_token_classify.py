"""Token classifiers (``*ForTokenClassification``): ``LLM.reward`` and
``encode(pooling_task="token_classify")`` against transformers, random weights."""

from __future__ import annotations

import pytest
import torch
from encoder_models import make_encoder

from tokenmill import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.pooling import PoolingParams

TEXTS = ["hello world", "a somewhat longer input with more words in it", "ünïcode ✓", "x"]


@pytest.mark.parametrize("arch", ["BertForTokenClassification", "RobertaForTokenClassification"])
def test_reward_is_per_token_probabilities(tmp_path, minilm_dir, arch):
    import transformers

    pad = 1 if arch.startswith("Roberta") else 0
    path = make_encoder(tmp_path / arch, minilm_dir, arch, num_labels=3, pad_token_id=pad)
    ref_model = getattr(transformers, arch).from_pretrained(path).eval()
    llm = LLM(str(path))
    assert llm.llm_engine.task == "token_classify"
    batch = llm.get_tokenizer()(TEXTS, padding=True, return_tensors="pt")
    if arch.startswith("Roberta"):
        batch.pop("token_type_ids")
    with torch.no_grad():
        ref = ref_model(**batch).logits  # [B, L, 3]
    probs = llm.reward(TEXTS)
    logits = llm.encode(TEXTS, PoolingParams(activation=False), pooling_task="token_classify")
    for i, (p, raw) in enumerate(zip(probs, logits, strict=True)):
        n = int(batch["attention_mask"][i].sum())
        assert p.prompt_token_ids == batch["input_ids"][i, :n].tolist()
        torch.testing.assert_close(raw.outputs.data, ref[i, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p.outputs.data, ref[i, :n].softmax(-1), atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="token_classify"):
        llm.embed(TEXTS)
    llm.close()


def test_reward_needs_a_token_classifier(tmp_path, minilm_dir):
    llm = LLM(str(make_encoder(tmp_path / "m", minilm_dir, "BertModel")))
    with pytest.raises(InvalidRequestError, match="ForTokenClassification"):
        llm.reward(TEXTS)
    llm.close()
