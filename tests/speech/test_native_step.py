"""Whisper's native decode step (one C call per layer) against the PyTorch layers."""

from __future__ import annotations

import pytest
import torch


def _loaded(whisper_ct2, monkeypatch, mode: str):
    from tokenmill import native
    from tokenmill.speech.loader import load_whisper

    if native.active_isa() is None:
        pytest.skip("no native kernels here")
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", mode)
    return load_whisper(whisper_ct2).model


def test_built_where_the_layers_are_packed(whisper_ct2, monkeypatch):
    assert _loaded(whisper_ct2, monkeypatch, "native").decoder.native is not None
    assert _loaded(whisper_ct2, monkeypatch, "torch").decoder.native is None


def test_native_steps_equal_the_pytorch_layers(whisper_ct2, monkeypatch):
    """Three rows at different positions, 20 steps each way from the same cache contents:
    logits equal up to float32 rounding with the same greedy pick, and the self-attention
    K/V written to the same cache places."""
    from tokenmill.speech.whisper import DecoderCache

    model = _loaded(whisper_ct2, monkeypatch, "native")
    dec, stepper = model.decoder, model.decoder.native
    torch.manual_seed(0)
    enc = torch.randn(3, model.cfg.max_source_positions, model.cfg.d_model)
    tokens = torch.randint(0, 50000, (3, 20))
    start = torch.tensor([0, 3, 7])  # rows at different lengths
    logits, caches = [], []
    with torch.inference_mode():
        for native_on in (True, False):
            dec.native = stepper if native_on else None
            cache = DecoderCache(model.cfg, 4, torch.float32)
            dec.set_cross(enc, cache, slice(0, 3))
            steps = [dec(tokens[:, t : t + 1], start + t, cache, slice(0, 3)) for t in range(20)]
            logits.append(torch.stack(steps))  # [20, 3, V]
            caches.append(cache)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-3)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
    torch.testing.assert_close(caches[0].self_k, caches[1].self_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[0].self_v, caches[1].self_v, rtol=1e-4, atol=1e-4)
    written = caches[0].self_k[:, :3].abs().sum(-1) != 0  # [L, 3, H, max_len]
    for row, first in enumerate(start.tolist()):
        assert written[:, row, :, first : first + 20].all()
        assert not written[:, row, :, first + 20 :].any() and not written[:, row, :, :first].any()
