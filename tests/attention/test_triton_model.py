"""A tiny random Llama generates the same greedy tokens with the triton backend
(interpreted on CPU, float32) as with the reference backend."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.attention import AttentionMetadata, ForwardContext  # noqa: E402
from tokenmill.attention.backends import AttentionBackend, select_backend  # noqa: E402
from tokenmill.models import resolve_model_class  # noqa: E402

BLOCK_SIZE = 4


class _Driver:
    """Flattened steps over a scattered paged cache, with a chosen attention backend."""

    def __init__(self, model, backend: AttentionBackend, num_blocks: int = 48) -> None:
        self.model, self.backend = model, backend
        shape = (2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        self.caches = [torch.zeros(shape) for _ in range(model.num_layers)]
        self.free = list(range(1, num_blocks))
        random.Random(0).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """{seq: new token ids} -> {seq: logits of its last new token}."""
        query_lens, seq_lens, tables, ids, positions = [], [], [], [], []
        for seq, new in chunks.items():
            start = self.lens.get(seq, 0)
            end = self.lens[seq] = start + len(new)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            query_lens.append(len(new))
            seq_lens.append(end)
            tables.append(list(table))
            ids += new
            positions += range(start, end)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
        ctx = ForwardContext(meta, self.caches, self.backend)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
        last = [meta.query_start_loc[i + 1] - 1 for i in range(len(chunks))]
        logits = self.model.compute_logits(hidden[last])
        return dict(zip(chunks, logits))


def _generate(model, backend, prompts: list[list[int]], steps: int):
    """Prompt 0 whole and prompt 1 in two chunks (the second beside prompt 0's first decode),
    then batched decodes. Returns (tokens per prompt, every step's logits)."""
    driver = _Driver(model, backend)
    half = len(prompts[1]) // 2
    seen = [driver.step({0: prompts[0], 1: prompts[1][:half]})]
    out = {0: [int(seen[0][0].argmax())], 1: []}
    seen.append(driver.step({0: out[0][-1:], 1: prompts[1][half:]}))
    out[0].append(int(seen[-1][0].argmax()))
    out[1].append(int(seen[-1][1].argmax()))
    while len(out[1]) < steps:
        seen.append(driver.step({seq: toks[-1:] for seq, toks in out.items()}))
        for seq, logits in seen[-1].items():
            out[seq].append(int(logits.argmax()))
    return out, seen


def _tiny_llama():
    """2 layers, head_dim 64, 2 query heads per KV head; weights at std 0.2 so that greedy
    choices are clear-cut (random init at std 0.02 gives near-ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    hf = LlamaForCausalLM(config).eval()
    model = resolve_model_class(["LlamaForCausalLM"])(config.to_dict(), torch.float32)
    model.load_weights(hf.state_dict().items())
    return model.eval()


def test_greedy_tokens_match_reference():
    model, cpu = _tiny_llama(), torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 14)]
    want, want_logits = _generate(model, select_backend("reference", cpu), prompts, 16)
    got, got_logits = _generate(model, select_backend("triton", cpu), prompts, 16)
    assert got == want
    for a, b in zip(got_logits, want_logits):
        for seq in a:
            torch.testing.assert_close(a[seq], b[seq], atol=1e-4, rtol=1e-4)
