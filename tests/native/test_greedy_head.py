"""The greedy head (``sampling/greedy_head.py``, ``dense16_greedy``): the tokens of the
full bfloat16 head's argmax, bit for bit, from one-term logits plus the exact kernel on
the candidates; taken only by steps whose rows are all plain greedy."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams, host_memory, native
from tokenmill.layers.linear import Linear
from tokenmill.native import dense16
from tokenmill.quant.dense16 import Dense16Method
from tokenmill.sampling import RowState, Sampler
from tokenmill.sampling.greedy_head import GreedyHead
from tokenmill.sampling.logits_processors import RowProcessor
from tokenmill.structured_output.params import StructuredOutputsParams

needs_bf16 = pytest.mark.skipif(
    not (native.available() and dense16.has_avx512_bf16()),
    reason="the greedy head needs AVX512-BF16 (the one-term kernel)",
)
EXACT = ["bf16-fma", "bf16-avx512bf16"]


def _tiles(w: torch.Tensor) -> torch.Tensor:
    tiles = dense16.empty_tiles(w.shape[0], w.shape[1], torch.bfloat16)
    dense16.write_rows(tiles, 0, w)
    return tiles


def _greedy(x: torch.Tensor, w: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense16.greedy's ids, the full head's argmax) for x [M, K], w [N, K] bfloat16."""
    tiles, kid, n = _tiles(w), dense16.KERNELS[kernel][0], w.shape[0]
    wnorm = dense16.max_row_norm(tiles, n)
    ids = dense16.greedy(x, tiles, kid, n, wnorm, torch.empty(x.shape[0] * n))
    return ids, dense16.gemm(x, tiles, kid, n).argmax(dim=-1)


@needs_bf16
@pytest.mark.parametrize("kernel", EXACT)
@pytest.mark.parametrize("m,n,k", [(2, 37, 19), (5, 1000, 64), (33, 4099, 576), (3, 17, 1)])
def test_the_full_heads_argmax(kernel, m, n, k) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, k, generator=g)
    # rows aligned with a head row (a clear winner) and plain noise (many near the top)
    x[::2] += 40 * w[torch.randint(0, n, ((m + 1) // 2,), generator=g)].float()
    ids, full = _greedy(x, w, kernel)
    assert torch.equal(ids, full)


@pytest.mark.parametrize("n,k", [(37, 19), (4099, 576), (300, 3000)])
def test_max_row_norm_bounds_every_row(n, k) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3).bfloat16()
    true = float(w.double().norm(dim=1).max())
    got = dense16.max_row_norm(_tiles(w), n)
    assert true <= got <= true * (1 + 1e-3)


@needs_bf16
@pytest.mark.parametrize("kernel", EXACT)
def test_an_order_that_one_term_gets_wrong(kernel) -> None:
    """x0 = 1 + 2^-10 and x1 = 1 + 2^-12 both round to 1.0 in bfloat16: the one-term logits
    of rows e1 (index 0) and e0 (index 1) tie and name index 0, the exact ones index 1."""
    k, n = 32, 100
    w = torch.zeros(n, k)
    w[0, 1], w[1, 0] = 1.0, 1.0
    w[2:, 2:] = torch.rand(n - 2, k - 2) * 0.01  # the rest far below
    x = torch.zeros(2, k)
    x[:, 0], x[:, 1] = 1 + 2**-10, 1 + 2**-12
    x[1, 2:] = 0.5
    one_term = dense16.gemm(x, _tiles(w.bfloat16()), dense16.KERNELS["bf16-avx512bf16-1"][0], n)
    assert one_term[0, 0] == one_term[0, 1]  # the trap is armed
    ids, full = _greedy(x, w.bfloat16(), kernel)
    assert ids.tolist() == full.tolist() == [1, 1]


@needs_bf16
def test_ties_go_to_the_first_index_and_a_zero_row_decides() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 48, generator=g).bfloat16()
    w[250] = w[17]  # two equal best rows: argmax takes 17
    x = torch.stack([w[17].float() * 3, torch.zeros(48)])  # a zero row: every logit 0 -> 0
    ids, full = _greedy(x, w, "bf16-fma")
    assert ids.tolist() == full.tolist() == [17, 0]


@needs_bf16
def test_a_non_finite_row_is_left_to_the_full_head() -> None:
    """A NaN input makes the row's bound meaningless: -1 from the kernel, and the head
    object computes that row in full (argmax counts NaN as the maximum)."""
    w = torch.randn(64, 16).bfloat16()
    method = Dense16Method("bf16-fma")
    layer = Linear(16, 64, method=method)
    layer.load_weight(w.float())
    x = torch.randn(3, 16)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    ids, full = _greedy(x, w, "bf16-fma")
    assert ids[1] == -1 and ids[2] == -1 and ids[0] == full[0]
    head = GreedyHead(layer, method)
    assert torch.equal(head(x), full)


@needs_bf16
def test_its_scratch_is_given_back_after_a_wide_step(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "KEEP_BYTES", 0)  # the rule of 16 MB+ buffers, small
    monkeypatch.setattr(host_memory, "SHRINK", 2)
    method = Dense16Method("bf16-fma")
    layer = Linear(32, 500, method=method)
    layer.load_weight(torch.randn(500, 32))
    head = GreedyHead(layer, method)
    wide, narrow = torch.randn(40, 32), torch.randn(3, 32)
    head(wide)
    assert head._approx.numel() == 40 * 500
    assert torch.equal(head(narrow), method.apply(layer, narrow, None).argmax(dim=-1))
    assert head._approx.numel() == 3 * 500


@pytest.mark.skipif(not native.available(), reason="no native kernels here")
@pytest.mark.parametrize("m", [1, 9, 40])
def test_rows_do_not_depend_on_their_batch(m) -> None:
    """A token's bits are the same alone and in a batch, whichever register blocks and
    next-pair fetches the batch size brings (``next_pair``: four blocks or more)."""
    g = torch.Generator().manual_seed(m)
    w = torch.randn(200, 96, generator=g).bfloat16()
    tiles, kid = _tiles(w), dense16.KERNELS["bf16-fma"][0]
    x = torch.randn(m, 96, generator=g)
    together = dense16.gemm(x, tiles, kid, 200)
    alone = torch.cat([dense16.gemm(x[i : i + 1], tiles, kid, 200) for i in range(m)])
    assert torch.equal(together, alone)


def _rows(*params: SamplingParams) -> list[RowState]:
    return [RowState(p, [1, 2, 3], []) for p in params]


@pytest.mark.parametrize(
    "other,argmax_only",
    [
        (SamplingParams(temperature=0), True),
        (SamplingParams(temperature=0, logprobs=1), False),
        (SamplingParams(temperature=0.7), False),
        (SamplingParams(temperature=0, repetition_penalty=1.2), False),
        (SamplingParams(temperature=0, logit_bias={5: 2.0}), False),
        (SamplingParams(temperature=0, min_tokens=3), False),
        (SamplingParams(temperature=0, bad_words=None, allowed_token_ids=[1, 2]), False),
    ],
)
def test_argmax_only_means_nothing_but_the_argmax(other, argmax_only) -> None:
    sampler = Sampler()
    rows = _rows(SamplingParams(temperature=0), other)
    assert sampler.argmax_only(rows, torch.device("cpu")) is argmax_only


def test_a_grammar_row_is_not_argmax_only() -> None:
    grammar = RowProcessor(lambda logits, rows, only: None, lambda row: row.params.n == 2)
    sampler = Sampler(extra_processors=(grammar,))
    plain = _rows(SamplingParams(temperature=0), SamplingParams(temperature=0))
    assert sampler.argmax_only(plain, torch.device("cpu"))
    masked = _rows(SamplingParams(temperature=0), SamplingParams(temperature=0, n=2))
    assert not sampler.argmax_only(masked, torch.device("cpu"))


# -- through the engine -------------------------------------------------------------------


def _bf16_model(tmp_path_factory, tokenizer, **overrides):
    """A tiny random Llama saved in bfloat16 (``dtype="auto"`` keeps it: a bf16 head)."""
    from tiny_models import make_tiny_llama
    from transformers import LlamaForCausalLM

    src = make_tiny_llama(tmp_path_factory.mktemp("f32"), tokenizer, **overrides)
    out = tmp_path_factory.mktemp("bf16")
    LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(
    scope="module",
    params=[
        dict(tie_word_embeddings=False),
        dict(tie_word_embeddings=True),
        dict(initializer_range=0.02),
    ],  # fmt: skip
    ids=["lm_head", "tied", "near_ties"],
)
def bf16_dir(request, tmp_path_factory, smollm2_hf_tokenizer):
    """The head as ``lm_head``, as the tied embedding table, and with weights at std 0.02,
    whose logits crowd near the top (many candidates)."""
    return _bf16_model(tmp_path_factory, smollm2_hf_tokenizer, **request.param)


ENGINE = dict(max_model_len=256, block_size=8, num_kv_blocks=128)


@pytest.fixture(scope="module")
def bf16_llm(bf16_dir):
    with LLM(str(bf16_dir), **ENGINE) as llm:
        yield llm


class _Counted:
    """The runner's greedy head, counting its calls."""

    def __init__(self, head: GreedyHead) -> None:
        self.head, self.calls = head, 0

    def takes(self, hidden: torch.Tensor) -> bool:
        return self.head.takes(hidden)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(hidden)


PROMPTS = [{"prompt_token_ids": [10 + i, 400 + 7 * i, 33, 900 + i]} for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(llm: LLM, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_the_engine_takes_it_only_where_it_applies(bf16_llm) -> None:
    runner = bf16_llm.engine.executor.runner
    head = runner.greedy_head
    if not (native.available() and dense16.has_avx512_bf16()):
        assert head is None  # nothing to take here: the full head always
        return
    assert head is not None and head.method.kernel in ("bf16-fma", "bf16-avx512bf16")
    counted = _Counted(head)
    try:
        runner.greedy_head = counted
        fast = _tokens(bf16_llm, GREEDY)
        assert counted.calls > 0
        with_lp = [GREEDY] * 5 + [SamplingParams(temperature=0, max_tokens=12, logprobs=2,
                                                  ignore_eos=True)]  # fmt: skip
        counted.calls = 0
        mixed = _tokens(bf16_llm, with_lp)
        assert counted.calls == 0  # a row with logprobs: every step computes the logits
        counted.calls = 0
        schema = StructuredOutputsParams(regex="[a-z ]{1,20}")
        guided = SamplingParams(temperature=0, max_tokens=12, structured_outputs=schema)
        bf16_llm.generate(PROMPTS[:3], guided, use_tqdm=False)
        assert counted.calls == 0  # a grammar's mask needs the logits
        runner.greedy_head = None
        full = _tokens(bf16_llm, GREEDY)
    finally:
        runner.greedy_head = head
    assert fast == full == mixed


@pytest.fixture(scope="module")
def repetitive_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return _bf16_model(tmp_path_factory, smollm2_hf_tokenizer, initializer_range=0.02)


@needs_bf16
def test_speculative_verify_steps_take_it_too(repetitive_dir) -> None:
    """n-gram drafts verified through the greedy head: the tokens of plain decoding. Each
    prompt is P + O + P, O the model's own continuation of P (this model then proposes)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(repetitive_dir), **ENGINE) as llm:
        firsts = [p["prompt_token_ids"] for p in PROMPTS[:4]]
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
        prompts = [{"prompt_token_ids": p + list(o) + p} for p, o in zip(firsts, outs)]
        llm.engine.executor.runner.greedy_head = None
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(repetitive_dir), speculative_config=ngram, **ENGINE) as llm:
        runner = llm.engine.executor.runner
        counted = _Counted(runner.greedy_head)
        runner.greedy_head = counted
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        drafted = llm.get_scheduling_metrics()["spec_decode_num_draft_tokens"]
    assert counted.calls > 0 and drafted > 0  # steps verified drafts through the head
    assert spec == plain
