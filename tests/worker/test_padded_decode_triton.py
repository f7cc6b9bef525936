"""The padded decode buffers with the real Triton kernels (interpreted on CPU): padding
rows (slot -1, seq_len 0) store nothing and change no real row, as graphs need."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # interpreted on CPU: see tests/conftest.py

from test_padded_decode import PARAMS, PROMPTS, assert_same, count_runs  # noqa: E402

from tokenmill import LLM  # noqa: E402
from tokenmill.attention.backends import triton_interpreted  # noqa: E402
from tokenmill.worker.cuda_graphs import PaddedDecode  # noqa: E402
from tokenmill.worker.model_runner import ModelRunner  # noqa: E402

MAX_MODEL_LEN, BS = 64, 4


def test_padded_decode_with_triton_kernels(tiny_llama_dir, monkeypatch):
    if torch.cuda.is_available() or not triton_interpreted():
        pytest.skip("CPU run of the Triton kernels under TRITON_INTERPRET=1")
    with LLM(str(tiny_llama_dir), dtype="float32", device="cpu", attention_backend="triton",
             max_model_len=MAX_MODEL_LEN, num_kv_blocks=96, block_size=BS,
             enable_prefix_caching=False, max_num_seqs=8) as llm:  # fmt: skip
        old = llm.engine.runner
        assert old.backend.name == "triton" and old.decode is None  # CPU: no graphs
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        eager = [o.outputs[0] for o in llm.generate(prompts, PARAMS)]
        decode = PaddedDecode(old.model, old.kv_caches, BS, MAX_MODEL_LEN, 8, old.device,
                              old.backend, capture=False)  # fmt: skip
        sizes = count_runs(decode, monkeypatch)
        llm.engine.runner = ModelRunner(
            old.model, old.kv_caches, BS, old.device, old.sampler, old.backend, decode
        )
        padded = [o.outputs[0] for o in llm.generate(prompts, PARAMS)]
    assert_same(padded, eager)
    assert set(sizes) == {5, 4, 3, 2, 1}
