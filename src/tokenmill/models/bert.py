"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) over a packed, padding-free batch.

Every linear layer sees only real tokens: ``[T, H]`` for the T tokens of all sequences
laid end to end. Only attention needs sequences apart; it runs per length group
(``PackedBatch``): a group of equal-length sequences is one batched SDPA call with no
mask, a mixed group is scattered into ``[B, L_max]`` and masked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}
ACTIVATIONS["gelu_pytorch_tanh"] = ACTIVATIONS["gelu_new"]


@dataclass(frozen=True)
class PackedBatch:
    """Where each sequence sits in the packed ``[T]`` token axis.

    Invariant: sequences are contiguous and in order; ``seq_lens`` sums to T.
    """

    seq_lens: tuple[int, ...]
    starts: torch.Tensor
    """[B] int64: offset of each sequence's first token."""
    lens: torch.Tensor
    """[B] int64."""
    pad_index: torch.Tensor | None
    """[T] int64: row of each token in the padded ``[B * L_max]`` layout; None when all
    sequences have the same length (the packed tensor *is* ``[B, L]``)."""
    key_mask: torch.Tensor | None
    """[B, 1, 1, L_max] bool, True on real keys; None with ``pad_index``."""
    precise_rows: torch.Tensor | None = None
    """[R] int64: token rows that int8 linears compute with their precise terms
    (``BertLayer.INT8_PRECISE_TERMS``); None: none (or no int8 linear)."""

    @staticmethod
    def of(seq_lens: Iterable[int]) -> PackedBatch:
        lens_list = tuple(int(n) for n in seq_lens)
        lens = torch.tensor(lens_list, dtype=torch.int64)
        starts = torch.cumsum(lens, 0) - lens
        if len(set(lens_list)) <= 1:
            return PackedBatch(lens_list, starts, lens, None, None)
        max_len = max(lens_list)
        seq_of = torch.repeat_interleave(torch.arange(len(lens_list)), lens)
        offset = torch.arange(int(lens.sum())) - starts[seq_of]
        pad_index = seq_of * max_len + offset
        key_mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
        return PackedBatch(lens_list, starts, lens, pad_index, key_mask)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def positions(self, offset: int = 0) -> torch.Tensor:
        """[T] int64: 0..len-1 within each sequence, plus ``offset``."""
        dev = self.lens.device
        seq_of = torch.repeat_interleave(torch.arange(self.num_seqs, device=dev), self.lens)
        total = sum(self.seq_lens)
        return torch.arange(total, device=dev) - self.starts[seq_of] + offset


def bidirectional_attention(
    qkv: torch.Tensor,
    batch: PackedBatch,
    num_heads: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """qkv [T, 3 * H] (q, k, v side by side) -> [T, H], each sequence attending to itself;
    ``window``: only keys at most that many positions away (local attention)."""
    total, width = qkv.shape
    hidden = width // 3
    head_dim = hidden // num_heads
    if batch.pad_index is None:
        b = batch.num_seqs
        x = qkv.view(b, total // b, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        band = _band(total // b, window, qkv.device)
        out = F.scaled_dot_product_attention(x[0], x[1], x[2], attn_mask=band, scale=scale)
        return out.transpose(1, 2).reshape(total, hidden)  # [B, h, L, d] -> [T, H]
    assert batch.key_mask is not None
    b, max_len = batch.num_seqs, batch.key_mask.shape[-1]
    padded = qkv.new_zeros(b * max_len, width)
    padded.index_copy_(0, batch.pad_index, qkv)
    x = padded.view(b, max_len, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    band = _band(max_len, window, qkv.device)
    mask = batch.key_mask if band is None else batch.key_mask & band
    out = F.scaled_dot_product_attention(x[0], x[1], x[2], attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(b * max_len, hidden).index_select(0, batch.pad_index)


def _band(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[L, L] bool, True where |query - key| <= window; None without a window."""
    if window is None or window >= length:
        return None
    idx = torch.arange(length, device=device)
    return (idx[:, None] - idx[None, :]).abs() <= window


class BertLayer(nn.Module):
    """Post-norm block: x = LN(x + attn(x)); x = LN(x + FFN(x)). q, k, v are one linear."""

    INT8_TERMS = {"qkv": 1, "attn_out": 1, "ffn_in": 1, "ffn_out": 1}
    """quantization='int8' (``pooling/quantize.py``): int8 terms per activation of each
    linear, for the rows of a mean-pooled sequence of ``INT8_AVERAGED_FROM`` tokens or more,
    whose mean averages the one-term rounding: on all-MiniLM-L6-v2, 400 inputs of 12 to
    256 tokens (random words, sentences, non-ASCII, long text), min cosine to float32
    0.99935 (bfloat16 activations 0.99923); two terms on qkv gave 0.99966."""
    INT8_PRECISE_TERMS = {"qkv": 2, "attn_out": 1, "ffn_in": 2, "ffn_out": 2}
    """The terms for every other row (``PackedBatch.precise_rows``): shorter mean-pooled
    sequences, and every row of CLS / MAX pooling, classifiers and token outputs, where
    one row's rounding reaches the output whole. qkv reads the post-norm stream, whose
    outlier channels one term per group of 32 holds worst. On MiniLM, 161 one- and
    two-word inputs: 12 under cosine 0.999 with one term on the FFN (min 0.99819), none
    with these (min 0.99938)."""
    INT8_AVERAGED_FROM = 12
    """Mean-pooled sequences this long take ``INT8_TERMS``: on MiniLM, 25 random-word inputs
    per length, qkv in two terms and the rest in one, the lowest cosine was 0.9990-0.9995 at
    3-7 tokens and >= 0.9994 from 8."""

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float, act: str) -> None:
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.ffn_in = nn.Linear(hidden, ffn)
        self.ffn_out = nn.Linear(ffn, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        rows = batch.precise_rows
        attn = bidirectional_attention(_linear(self.qkv, x, rows), batch, self.num_heads)
        x = self.attn_norm(_plus(self.attn_out, attn, x, rows))
        ffn = _activated(self.ffn_in, self.act, x, rows)
        return self.ffn_norm(_plus(self.ffn_out, ffn, x, rows))


def _linear(linear: nn.Module, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """linear(x), passing the int8 layers (``fuses_residual``) their precise rows."""
    if rows is not None and getattr(linear, "fuses_residual", False):
        return linear(x, precise_rows=rows)
    return linear(x)


def _plus(
    linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """residual + linear(x); in the matmul's own pass where the layer can (int8)."""
    if getattr(linear, "fuses_residual", False):
        return linear(x, residual, precise_rows=rows)
    return residual + linear(x)


def _activated(
    linear: nn.Module, act: Callable, x: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """act(linear(x)); exact GELU in the matmul's own pass where the layer can (int8)."""
    if act is F.gelu and getattr(linear, "fuses_gelu", False):
        return linear(x, gelu=True, precise_rows=rows)
    return act(_linear(linear, x, rows))


class BertEncoder(nn.Module):
    """Embeddings + layers: token ids [T] -> hidden states [T, H] (no pooling)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        if cfg.get("position_embedding_type", "absolute") not in (None, "absolute"):
            raise ModelLoadError(
                f"position_embedding_type={cfg['position_embedding_type']!r} is not supported; "
                "only absolute position embeddings are"
            )
        self.is_roberta = cfg.get("model_type") in ("roberta", "xlm-roberta", "camembert")
        # RoBERTa counts positions from padding_idx + 1 (fairseq's convention).
        self.position_offset = cfg.get("pad_token_id", 1) + 1 if self.is_roberta else 0
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(max(1, cfg.get("type_vocab_size", 2)), hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            BertLayer(
                hidden,
                cfg["num_attention_heads"],
                cfg["intermediate_size"],
                eps,
                cfg.get("hidden_act", "gelu"),
            )
            for _ in range(cfg["num_hidden_layers"])
        )
        self.max_positions = cfg["max_position_embeddings"] - self.position_offset

    def forward(
        self, input_ids: torch.Tensor, batch: PackedBatch, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        positions = batch.positions(self.position_offset)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, batch)
        return x


class ClassifierHead(nn.Module):
    """The first token of each sequence -> logits [B, num_labels].

    BERT: ``pooler.dense`` + tanh, then ``classifier``. RoBERTa: ``classifier.dense`` + tanh,
    then ``classifier.out_proj``. Both are dense -> tanh -> linear, named differently.
    """

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, num_labels)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first_tokens)))


class BertModel(nn.Module):
    """BertModel / RobertaModel / XLMRobertaModel: hidden states for a pooler."""

    has_classifier = False
    int8_layer = BertLayer

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = BertEncoder(cfg)
        self.hidden_size = cfg["hidden_size"]
        self.max_positions = self.encoder.max_positions

    def forward(
        self, input_ids: torch.Tensor, batch: PackedBatch, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """-> hidden states [T, H]."""
        return self.encoder(input_ids, batch, token_type_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (q, k, v fused on the fly); raise on missing ones."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            for name, part in _our_names(hf_name, self.has_classifier):
                if part is None:
                    _assign(params, name, tensor)
                    loaded.add(name)
                    continue
                parts = pending.setdefault(name, {})
                parts[part] = tensor
                if len(parts) == 3:
                    _assign(params, name, torch.cat([parts[p] for p in "qkv"], 0))
                    loaded.add(name)
                    del pending[name]
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(
                f"the checkpoint lacks {len(missing)} weights this model needs "
                f"(e.g. {missing[0]}); is it a {self.config.get('architectures')} checkpoint?"
            )


class BertForSequenceClassification(BertModel):
    """BertForSequenceClassification / RobertaForSequenceClassification: logits per sequence."""

    has_classifier = True

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        self.num_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
        self.classifier = ClassifierHead(cfg["hidden_size"], self.num_labels)

    def classify(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """hidden [T, H] -> logits [B, num_labels] (from each sequence's first token)."""
        return self.classifier(hidden.index_select(0, batch.starts))


class TokenHead(nn.Module):
    """HF's ``classifier`` linear of a token classifier (``classifier.out`` here, the name
    the sequence classifiers' last linear loads into)."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.out = nn.Linear(hidden, num_labels)


class BertForTokenClassification(BertModel):
    """BertForTokenClassification / RobertaForTokenClassification: logits per token
    (the ``token_classify`` task, ``LLM.reward``)."""

    has_classifier = True
    per_token = True

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        self.num_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
        self.classifier = TokenHead(cfg["hidden_size"], self.num_labels)

    def classify(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """hidden [T, H] -> logits [T, num_labels]."""
        return self.classifier.out(hidden)


_PREFIXES = ("bert.", "roberta.", "model.")
_LAYER_PARTS = {
    "attention.self.query": ("qkv", "q"),
    "attention.self.key": ("qkv", "k"),
    "attention.self.value": ("qkv", "v"),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("ffn_in", None),
    "output.dense": ("ffn_out", None),
    "output.LayerNorm": ("ffn_norm", None),
}
_TOP = {
    "embeddings.word_embeddings": "encoder.word_embeddings",
    "embeddings.position_embeddings": "encoder.position_embeddings",
    "embeddings.token_type_embeddings": "encoder.token_type_embeddings",
    "embeddings.LayerNorm": "encoder.embed_norm",
}
_HEAD = {
    "pooler.dense": "classifier.dense",  # BERT
    "classifier": "classifier.out",  # BERT
    "classifier.dense": "classifier.dense",  # RoBERTa
    "classifier.out_proj": "classifier.out",  # RoBERTa
}


def _our_names(hf_name: str, with_head: bool) -> Iterator[tuple[str, str | None]]:
    """HF name -> (our parameter name, q/k/v part or None); nothing for unused tensors
    (``position_ids`` buffers, a BertModel's pooler)."""
    for prefix in _PREFIXES:
        if hf_name.startswith(prefix):
            hf_name = hf_name[len(prefix) :]
            break
    module, _, leaf = hf_name.rpartition(".")
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
    if module in _TOP:
        yield f"{_TOP[module]}.{leaf}", None
    elif module.startswith("encoder.layer."):
        index, _, rest = module[len("encoder.layer.") :].partition(".")
        if rest in _LAYER_PARTS:
            ours, part = _LAYER_PARTS[rest]
            yield f"encoder.layers.{index}.{ours}.{leaf}", part
    elif with_head and module in _HEAD:
        yield f"{_HEAD[module]}.{leaf}", None


def _assign(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    param = params.get(name)
    if param is None:
        return
    if param.shape != tensor.shape:
        raise ModelLoadError(
            f"weight {name}: the checkpoint has shape {tuple(tensor.shape)}, the config "
            f"implies {tuple(param.shape)}; config.json and the weights disagree"
        )
    with torch.no_grad():
        param.copy_(tensor)
