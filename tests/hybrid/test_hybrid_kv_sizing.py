"""KV sizing counts the paged layers a hybrid declares, and a vision checkpoint's context
limit comes from its text_config."""

from __future__ import annotations

import pytest
from hybrid_checkpoints import hybrid_llm, make_mamba2, make_qwen3_5, make_qwen3_5_vl

from tokenmill.engine.loading import kv_cache_blocks
from tokenmill.kv_cache.spec import FullAttention, bytes_per_block


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_kv"), smollm2_hf_tokenizer)


def test_blocks_are_sized_by_the_attention_layers_only(qwen_dir):
    budget = 1 << 20
    llm = hybrid_llm(qwen_dir, num_kv_blocks=None, kv_cache_memory_bytes=budget)
    engine = llm.engine
    specs = engine.runner.model.cache_specs()
    paged = [s for s in specs if isinstance(s, FullAttention)]
    assert 0 < len(paged) < len(specs)  # 1 attention layer of 4
    per_block = bytes_per_block(paged, engine.config.block_size)
    assert kv_cache_blocks(engine.config, engine.loaded) == budget // per_block
    assert engine.kv.num_free_blocks == budget // per_block


def test_a_model_without_attention_layers_needs_no_kv_budget(tmp_path, smollm2_hf_tokenizer):
    path = make_mamba2(tmp_path / "m", smollm2_hf_tokenizer)
    llm = hybrid_llm(path, num_kv_blocks=None, kv_cache_memory_bytes=1, max_num_seqs=3)
    config = llm.engine.config
    assert kv_cache_blocks(config, llm.engine.loaded) == 3 * -(-128 // config.block_size)


def test_vision_checkpoint_limit_from_its_text_config(tmp_path, smollm2_hf_tokenizer):
    import json

    path = make_qwen3_5_vl(tmp_path / "vl", smollm2_hf_tokenizer)
    config = json.loads((path / "config.json").read_text())
    limit = config["text_config"]["max_position_embeddings"]
    assert "max_position_embeddings" not in config and limit != 2048
    llm = hybrid_llm(path, max_model_len=None, num_kv_blocks=None)
    assert llm.engine.max_model_len == limit
