"""A draft's lm_head cut to part of the vocabulary (``draft_vocab_size``): the kept rows'
logits are the whole head's, the others -inf; the drafts stay in the kept ids and the
output is plain greedy decoding's, since the target decides every token."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from tokenmill import LLM, SamplingParams, native
from tokenmill.errors import InvalidRequestError
from tokenmill.spec_decode.draft_head import PartialHead, trim_lm_head
from tokenmill.spec_decode.proposer import DraftHook

PROMPTS = [[1, *range(40 + 9 * i, 40 + 9 * i + n)] for i, n in enumerate((5, 23, 11))]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
OPTS = dict(dtype="float32", max_model_len=128, num_kv_blocks=96, block_size=4)


def test_dense_head_keeps_its_rows_and_masks_the_rest() -> None:
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(32, 400, bias=True)
    model = types.SimpleNamespace(lm_head=head)
    assert trim_lm_head(model, 50, [2, 390])  # 50 -> 64 rows, specials from tile 384 on
    x = torch.randn(3, 32, generator=gen)
    got, full = model.lm_head(x), head(x).detach()
    torch.testing.assert_close(got[:, :64], full[:, :64])
    torch.testing.assert_close(got[:, 384:], full[:, 384:])
    assert torch.isneginf(got[:, 64:384]).all()


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("bits", [4, 8])
def test_affine_group_head_cuts_whole_tiles(bits) -> None:
    gen = torch.Generator().manual_seed(bits)
    n, k = 320, 64
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.1
    offset = -torch.rand(n, k // 32, generator=gen)
    head = nn.Module()
    head.qtiles = native.pack_tiles(codes, scale, offset, bits)
    head.method, head.out_features, head.bias = types.SimpleNamespace(bits=bits), n, None
    part = PartialHead(head, keep=96, tail=288)
    x = torch.randn(5, k, generator=gen)
    got, full = part(x), native.affine_gemm(x, head.qtiles, bits, n)
    assert torch.equal(got[:, :96], full[:, :96]) and torch.equal(got[:, 288:], full[:, 288:])
    assert torch.isneginf(got[:, 96:288]).all()


def test_a_cut_draft_proposes_kept_ids_and_keeps_the_output(tiny_llm, tiny_llama_dir) -> None:
    want = [
        list(o.outputs[0].token_ids)
        for o in tiny_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    ]
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3,
            "adaptive": False, "draft_vocab_size": 2000}  # fmt: skip
    with LLM(str(tiny_llama_dir), speculative_config=spec, **OPTS) as llm:
        (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
        proposer = hook.proposer
        proposed: list[int] = []
        propose = proposer.propose

        def spy(requests, k):
            drafts = propose(requests, k)
            proposed.extend(t for d in drafts for t in d)
            return drafts

        proposer.propose = spy
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert isinstance(proposer.runner.model.lm_head, PartialHead)
        tail = proposer.runner.model.lm_head.tail
        assert proposed and all(t < 2000 or t >= tail for t in proposed)


def test_draft_vocab_size_needs_a_draft_model() -> None:
    with pytest.raises(InvalidRequestError, match="draft_vocab_size"):
        LLM("unused", speculative_config={"method": "ngram", "draft_vocab_size": 100})
