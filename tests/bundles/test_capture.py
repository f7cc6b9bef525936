"""What a bundle captures of a model: every parameter and buffer, shared ones once."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_llama

from tokenmill.bundles.capture import assign_tensors, check_capturable, model_tensors
from tokenmill.config import EngineConfig
from tokenmill.engine.loading import load_model
from tokenmill.errors import ModelLoadError


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_tiny_llama(tmp_path_factory.mktemp("tied"), smollm2_hf_tokenizer,
                           tie_word_embeddings=True)  # fmt: skip


def test_tied_head_is_stored_once_and_stays_shared(tied_dir, tmp_path):
    config = EngineConfig(model=str(tied_dir), dtype="float32", max_model_len=64,
                          prepare_bundle=True, cache_dir=str(tmp_path))  # fmt: skip
    cold = load_model(config)
    tensors, aliases = model_tensors(cold.model)
    assert "model.rotaries.0.cos_cache" in tensors  # non-persistent buffers too
    warm = load_model(config)
    for name, t in warm.model.state_dict().items():
        assert torch.equal(t, cold.model.state_dict()[name]), name
    shared = {id(p) for p in cold.model.parameters()}
    assert len({id(p) for p in warm.model.parameters()}) == len(shared)
    ids = torch.tensor([1, 5, 9])
    assert torch.equal(cold.model.compute_logits(cold.model.model.embed_tokens(ids)),
                       warm.model.compute_logits(warm.model.model.embed_tokens(ids)))  # fmt: skip


def test_uncapturable_state_is_refused(tiny_llama_dir):
    loaded = load_model(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=64))
    check_capturable(loaded.model)
    loaded.model.model.norm.cached = torch.zeros(3)  # a tensor no bundle would restore
    with pytest.raises(ModelLoadError, match="model.norm.cached"):
        check_capturable(loaded.model)


def test_assign_checks_names_and_shapes(tiny_llama_dir):
    loaded = load_model(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=64))
    tensors, aliases = model_tensors(loaded.model)
    name = "model.norm.weight"
    with pytest.raises(ModelLoadError, match="missing"):
        assign_tensors(loaded.model, {k: v for k, v in tensors.items() if k != name}, aliases)
    bad = dict(tensors, **{name: torch.zeros(3)})
    with pytest.raises(ModelLoadError, match=name):
        assign_tensors(loaded.model, bad, aliases)
