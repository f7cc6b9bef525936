"""A tiny random Llama generates the same greedy tokens with the fused layer ops (interpreted
on CPU, float32) as with the PyTorch/native paths.

Dense float32 norms take HF's exact rounding, which the fused kernel does not replace, so
every RMSNorm here is switched to the fast form (``exact=False``, as quantized models build
them) in both runs: the comparison is fused kernels vs the fast form they replace.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_runner import PagedRunner, build_ours  # noqa: E402

from tokenmill.layers import triton_ops  # noqa: E402
from tokenmill.layers.norm import RMSNorm  # noqa: E402
from tokenmill.layers.ops import Ops, triton_kernels  # noqa: E402


def _tiny_llama(ops: Ops | None = None):
    """2 layers; hidden 96, head_dim 48 and intermediate 160 are not powers of two; weights
    at std 0.2 so that greedy choices are clear-cut."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    model = build_ours(LlamaForCausalLM(config).eval(), ops)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.exact = False
    return model


def _generate(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list]:
    """Both prompts prefilled in one step, then batched greedy decodes (reference attention).
    Returns (tokens per prompt, every step's last-token logits)."""
    runner = PagedRunner(model)
    out: list[list[int]] = [[], []]
    new = [list(p) for p in prompts]
    logits_seen = []
    for _ in range(steps):
        logits = torch.stack(runner.last([(str(i), n) for i, n in enumerate(new)]))
        logits_seen.append(logits)
        new = [[int(t)] for t in logits.argmax(-1)]
        for o, n in zip(out, new):
            o += n
    return out, logits_seen


def test_greedy_tokens_match_without_fused_ops(device, monkeypatch):
    if device.type != "cpu":
        pytest.skip("the model runs in float32 on CPU here")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 14)]
    want, want_logits = _generate(_tiny_llama(Ops()), prompts, 16)  # PyTorch kernels

    calls = dict.fromkeys(("add_rms_norm", "rms_norm", "silu_and_mul", "rotate_"), 0)
    for name in calls:  # count the launches, so that the fused path is known to have run
        op = getattr(triton_ops, name)

        def counted(*args, _op=op, _name=name):
            calls[_name] += 1
            return _op(*args)

        monkeypatch.setattr(triton_ops, name, counted)
    got, got_logits = _generate(_tiny_llama(Ops(kernels=triton_kernels())), prompts, 16)

    assert got == want
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # Per step and layer: 2 norms (1 alone in layer 0) + final norm, 1 SiLU, 1 rotary.
    assert calls == {"add_rms_norm": 16 * 4, "rms_norm": 16, "silu_and_mul": 32, "rotate_": 32}
