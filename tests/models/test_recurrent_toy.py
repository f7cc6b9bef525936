"""A toy hybrid model: attention layers around a layer whose cache is a recurrent state.

The recurrent layer keeps one vector per request, h = decay * h + W x per token, in a
state slot handed out by the KV cache coordinator; the attention layers use paged blocks.
Greedy output of the engine must equal a plain computation over the whole sequence (no
cache of any kind), alone, with concurrent requests, and under preemption (a tiny cache:
slots are freed, and restored by recomputing from token 0).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.kv_cache import KVCacheCoordinator
from tokenmill.kv_cache.spec import CacheSpec, FullAttention, RecurrentState
from tokenmill.layers.attention import Attention, AttentionSpec
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import Ops
from tokenmill.layers.rotary import RopeConfig, RotaryEmbedding
from tokenmill.models.base import CausalLM
from tokenmill.sampling_params import SamplingParams

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32, 2, 1, 16
DECAY = 0.8


class Recurrent(nn.Module):
    """x [T, hidden] -> x + U tanh(h_t), h_t = DECAY * h_{t-1} + W x_t per sequence; the
    state after the step's last token goes back to the sequence's slot, and the states the
    step keeps inside a chunk (``run_saves``: a prompt's last token but one) go to their
    snapshot rows, as every recurrent layer must (a prefix hit resumes from them)."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.w = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.3, requires_grad=False)
        self.u = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.3, requires_grad=False)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        state, meta = ctx.kv_caches[self.layer_idx], ctx.state  # [slots, hidden]
        assert state is not None and meta is not None, "a recurrent layer needs its slots"
        drive = x @ self.w.T  # [T, hidden]
        hs = torch.empty_like(x)
        qsl = ctx.attn.query_start_loc
        for i, (slot, fresh) in enumerate(zip(meta.slot_list, meta.fresh_list)):
            h = torch.zeros(HIDDEN) if fresh else state[slot]
            saves = dict(meta.run_saves[i]) if meta.run_saves else {}  # tokens in -> row
            for t in range(qsl[i], qsl[i + 1]):
                h = DECAY * h + drive[t]
                hs[t] = h
                row = saves.get(t - qsl[i] + 1)
                if row is not None:
                    assert meta.snapshots is not None
                    meta.snapshots[self.layer_idx][row] = h  # type: ignore[index]
            if qsl[i + 1] > qsl[i]:
                state[slot] = h
        return x + torch.tanh(hs) @ self.u.T

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """One whole sequence x [L, hidden], from a zero state."""
        h, hs = torch.zeros(HIDDEN), []
        for row in x @ self.w.T:
            h = DECAY * h + row
            hs.append(h)
        return x + torch.tanh(torch.stack(hs)) @ self.u.T


class AttentionBlock(nn.Module):
    """x + attn(norm(x)) over the paged cache."""

    def __init__(self, layer_idx: int, rotary: RotaryEmbedding, ops: Ops) -> None:
        super().__init__()
        spec = AttentionSpec(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
        self.norm = RMSNorm(HIDDEN, 1e-6, dtype=torch.float32, ops=ops)
        self.attn = Attention(spec, layer_idx, rotary, torch.float32, ops=ops)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        rope = self.attn.rotary_emb.tables(positions)
        return x + self.attn(rope, self.norm(x), ctx)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain causal attention over the whole sequence x [L, hidden]."""
        attn, length = self.attn, x.shape[0]
        qkv = attn.qkv_proj(self.norm(x))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(length, HEADS, HEAD_DIM).clone()
        k = k.reshape(length, KV_HEADS, HEAD_DIM).clone()
        tables = attn.rotary_emb.tables(torch.arange(length))
        attn.rotary_emb.rotate_(q, tables)
        attn.rotary_emb.rotate_(k, tables)
        group = HEADS // KV_HEADS
        keys = k.repeat_interleave(group, 1).transpose(0, 1)
        values = v.reshape(length, KV_HEADS, HEAD_DIM).repeat_interleave(group, 1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True)
        return x + attn.o_proj(out.transpose(0, 1).reshape(length, HEADS * HEAD_DIM))


class ToyHybrid(CausalLM):
    """Embedding, [attention, recurrent, attention], norm, head."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.num_layers, self.num_kv_heads, self.head_dim = 3, KV_HEADS, HEAD_DIM
        self.vocab_size, self.dtype, self.ops = vocab_size, torch.float32, Ops()
        rotary = RotaryEmbedding(HEAD_DIM, 512, RopeConfig(), torch.float32, self.ops)
        self.embed = nn.Parameter(torch.randn(vocab_size, HIDDEN), requires_grad=False)
        self.layers = nn.ModuleList(
            [AttentionBlock(0, rotary, self.ops), Recurrent(1), AttentionBlock(2, rotary, self.ops)]
        )
        self.head = Linear(HIDDEN, vocab_size)
        for block in (self.layers[0], self.layers[2]):
            for p in block.parameters():
                p.data.normal_(0, 0.3)
            block.norm.weight.data.fill_(1.0)
        self.head.weight.data.normal_(0, 0.5)

    def cache_specs(self) -> list[CacheSpec]:
        full = FullAttention(KV_HEADS, HEAD_DIM, torch.float32)
        return [full, RecurrentState((HIDDEN,), torch.float32), full]

    def forward(self, input_ids, positions, ctx):
        x = self.embed[input_ids]
        x = self.layers[0](x, positions, ctx)
        x = self.layers[1](x, ctx)
        return self.layers[2](x, positions, ctx)

    def compute_logits(self, hidden):
        return self.head(hidden).float()

    def load_weights(self, weights):
        return set()

    @torch.no_grad()
    def reference_greedy(self, prompt: list[int], steps: int) -> list[int]:
        """Greedy tokens, each from a computation over the whole sequence so far."""
        tokens = list(prompt)
        for _ in range(steps):
            x = self.embed[torch.tensor(tokens)]
            x = self.layers[1].reference(self.layers[0].reference(x))
            x = self.layers[2].reference(x)
            tokens.append(int(self.compute_logits(x[-1:]).argmax()))
        return tokens[len(prompt) :]


def _engine(tiny_llama_dir, **options):
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.engine.loading import load_model

    options = {"max_model_len": 128, **options}
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4,
        check_kv_integrity=True, **options,
    )  # fmt: skip
    loaded = load_model(config)
    toy = ToyHybrid(loaded.model.vocab_size).eval()
    return LLMEngine(config, dataclasses.replace(loaded, model=toy)), toy


def _run(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [7, 7, 1000, 12, 40, 41, 3, 5, 1, 2, 60], [300, 2]]


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_llama_dir):
    engine, toy = _engine(tiny_llama_dir, num_kv_blocks=64)
    return engine, [toy.reference_greedy(p, 12) for p in PROMPTS]


def test_slots_follow_the_requests(prompts_and_reference):
    engine, want = prompts_and_reference
    kv = engine.kv
    assert isinstance(kv, KVCacheCoordinator) and [g.layers for g in kv.groups] == [(0, 2), (1,)]
    assert _run(engine, PROMPTS[:1], 12) == want[:1]  # alone
    assert _run(engine, PROMPTS[:2], 12) == want[:2]  # two concurrent requests
    assert kv.slots.num_free == kv.slots.num_slots and kv.num_free_blocks == kv.num_blocks


def test_three_concurrent_requests_chunked(tiny_llama_dir, prompts_and_reference):
    _, want = prompts_and_reference
    engine, _ = _engine(tiny_llama_dir, num_kv_blocks=64, long_prefill_token_threshold=3)
    assert _run(engine, PROMPTS, 12) == want


def test_preemption_frees_slots_and_recomputes(tiny_llama_dir, prompts_and_reference):
    """8 blocks of 4 tokens hold about one and a half of these sequences: requests are
    preempted (blocks and state slot freed) and recomputed, and the tokens do not change."""
    _, want = prompts_and_reference
    engine, _ = _engine(tiny_llama_dir, num_kv_blocks=8, max_model_len=32)
    assert _run(engine, PROMPTS, 12) == want
    assert engine.scheduler.num_preemptions > 0
    kv = engine.kv
    assert kv.slots.num_free == kv.slots.num_slots and kv.num_free_blocks == kv.num_blocks
