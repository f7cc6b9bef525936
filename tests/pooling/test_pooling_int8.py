"""quantization='int8' for encoders: all-MiniLM-L6-v2 int8 against its float32 output,
offline and through /v1/embeddings; the combinations it refuses."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM, native
from tokenmill.errors import InvalidRequestError
from tokenmill.models.bert import BertLayer, BertModel, PackedBatch
from tokenmill.models.modernbert import ModernBertModel
from tokenmill.pooling import PoolingParams
from tokenmill.pooling.quantize import resolve_pooling_quantization
from tokenmill.quant.rows import RowsInt8Linear

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

VARIED = [
    "Hello world",
    "x",
    "A man is eating food.",
    "Ünïcödé façade — naïve café 日本語のテキスト Привет мир ✓",
    "The quick brown fox jumps over the lazy dog near the river bank number 7",
    "Long text about rivers and mountains and the sea. " * 12,
    "An extremely long sentence that goes on and on about nothing in particular. " * 40,
]

# One- and two-word inputs: mean pooling averages the one-term rounding over 3-4 rows
# only. Before the precise rows, "ok", "?" and 10 more of 161 such inputs fell under
# cosine 0.999 (min 0.9982).
SHORT = (
    "ok yes no ? ! hi a the cat dog run go stop help why how what who when where x 1 . , "
    "love hate good bad hello thanks sorry please"
).split() + ["Ok!", "Good night", "Red car", "Why?", "Thanks a lot"]


@pytest.fixture(scope="module")
def minilm_int8(minilm_dir):
    llm = LLM(str(minilm_dir), quantization="int8")
    yield llm
    llm.close()


def _vectors(llm: LLM, texts: list[str], **kw) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, **kw)])


def test_int8_layers_are_swapped(minilm_int8):
    layer = minilm_int8.llm_engine.model.encoder.layers[0]
    assert {n: type(getattr(layer, n)) for n in ("qkv", "attn_out", "ffn_in", "ffn_out")} == {
        n: RowsInt8Linear for n in ("qkv", "attn_out", "ffn_in", "ffn_out")
    }
    assert layer.qkv.terms == 1 and layer.qkv.precise_terms == 2 and layer.ffn_out.terms == 1
    assert not any(
        n.endswith("ffn_in.weight") for n, _ in minilm_int8.llm_engine.model.named_parameters()
    )


def test_int8_matches_float32(minilm, minilm_int8):
    ref = _vectors(minilm, VARIED, truncate_prompt_tokens=-1)
    got = _vectors(minilm_int8, VARIED, truncate_prompt_tokens=-1)
    cos = F.cosine_similarity(got, ref, dim=-1)
    assert cos.min() >= 0.999, cos
    assert cos.min() < 0.999999  # the int8 path really ran
    cut = PoolingParams(truncate_prompt_tokens=12)
    short = F.cosine_similarity(
        _vectors(minilm_int8, VARIED[-2:], pooling_params=cut),
        _vectors(minilm, VARIED[-2:], pooling_params=cut),
        dim=-1,
    )
    assert short.min() >= 0.999, short


def test_int8_short_inputs_hold_the_bar(minilm, minilm_int8):
    cos = F.cosine_similarity(_vectors(minilm_int8, SHORT), _vectors(minilm, SHORT), dim=-1)
    assert cos.min() >= 0.999, [(SHORT[i], float(cos[i])) for i in torch.argsort(cos)[:3]]


def test_precise_rows_follow_each_sequence(minilm_int8):
    """Mean pooling: only the rows of sequences under ``int8_averaged_from`` tokens; any
    other output: every row; a batch of long sequences: none."""
    runner = minilm_int8.llm_engine.runner
    cut = runner.averaged_from
    assert cut == BertLayer.INT8_AVERAGED_FROM
    batch = PackedBatch.of([cut + 3, 2, cut, cut - 1])
    rows = runner._precise_rows(batch, "pooled").tolist()
    assert rows == [*range(cut + 3, cut + 5), *range(2 * cut + 5, 3 * cut + 4)]
    assert runner._precise_rows(batch, "logits").tolist() == list(range(3 * cut + 4))
    assert runner._precise_rows(PackedBatch.of([cut, cut + 1]), "pooled") is None
    assert runner._precise_rows(PackedBatch.of([1, 2]), "pooled").tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_precise_rows_equal_a_precise_layer(dtype):
    torch.manual_seed(0)
    w, b = torch.randn(64, 96) * 0.1, torch.randn(64)
    fast, precise = RowsInt8Linear(w, b, 1, 2), RowsInt8Linear(w, b, 2)
    x, res = torch.randn(9, 96).to(dtype), torch.randn(9, 64).to(dtype)
    rows = torch.tensor([1, 4, 5, 8])
    got = fast(x, res, gelu=True, precise_rows=rows)
    want_precise = precise(x, res, gelu=True)
    want_fast = fast(x, res, gelu=True)
    others = torch.tensor([0, 2, 3, 6, 7])
    assert torch.equal(got[rows], want_precise[rows])
    assert torch.equal(got[others], want_fast[others])
    assert not torch.equal(want_fast[rows], want_precise[rows])  # the terms really differ
    assert torch.equal(fast(x, precise_rows=torch.arange(9)), precise(x))


def test_int8_with_bfloat16_activations(minilm_dir, minilm):
    llm = LLM(str(minilm_dir), quantization="int8", dtype="bfloat16")
    try:
        got = _vectors(llm, VARIED + SHORT, truncate_prompt_tokens=-1)
        assert llm.llm_engine.model.encoder.layers[0].attn_norm.weight.dtype == torch.bfloat16
    finally:
        llm.close()
    ref = _vectors(minilm, VARIED + SHORT, truncate_prompt_tokens=-1)
    assert F.cosine_similarity(got, ref, dim=-1).min() >= 0.999


def test_int8_batch_and_alone_agree(minilm_int8):
    # Rows are quantized alone, but float32's last bits differ with the batch shape and
    # an int8 rounding can flip on them: agreement to the int8 bar, not to float32's.
    batch = _vectors(minilm_int8, VARIED[:5])
    alone = torch.cat([_vectors(minilm_int8, [s]) for s in VARIED[:5]])
    assert F.cosine_similarity(batch, alone, dim=-1).min() >= 0.9995


def test_int8_over_http(minilm, minilm_int8):
    from tokenmill.entrypoints.openai.launcher import OpenAIServer
    from tokenmill.entrypoints.openai.state import ServerConfig

    srv = OpenAIServer(minilm_int8.llm_engine, ServerConfig(port=0, log_level="warning"))
    srv.start()
    srv.wait_ready(60)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/embeddings", json={"input": VARIED[:5]})
        assert r.status_code == 200, r.text
        got = torch.tensor([d["embedding"] for d in r.json()["data"]])
    finally:
        srv.close(timeout=30)
    assert F.cosine_similarity(got, _vectors(minilm, VARIED[:5]), dim=-1).min() >= 0.999


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"quantization": "int4"}, "not supported for pooling models"),
        ({"quantization": "gguf"}, "not supported for pooling models"),
        ({"quantization": "int8", "dtype": "float16"}, "dtype='float16' does not combine"),
    ],
)
def test_bad_combinations_refused(minilm_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(minilm_dir), **kwargs)


def test_int8_refused_where_no_path():
    cpu = torch.device("cpu")
    with pytest.raises(InvalidRequestError, match="ModernBertModel"):
        resolve_pooling_quantization("int8", "auto", cpu, ModernBertModel, False)
    with pytest.raises(InvalidRequestError, match="BERT-family"):
        resolve_pooling_quantization("int8", "auto", cpu, BertModel, True)
    with pytest.raises(InvalidRequestError, match="on cuda"):
        resolve_pooling_quantization("int8", "auto", torch.device("cuda"), BertModel, False)
    assert resolve_pooling_quantization("auto", "bfloat16", cpu, ModernBertModel, False) == "none"
    assert resolve_pooling_quantization("int8", "float32", cpu, BertModel, False) == "int8"
    with native.use(None), pytest.raises(InvalidRequestError, match=r"AVX2\+FMA\+F16C"):
        resolve_pooling_quantization("int8", "float32", cpu, BertModel, False)
