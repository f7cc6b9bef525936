"""Random-weight speculative heads in their published layouts, and reference drafts.

``make_eagle3_head`` writes an EAGLE-3 head folder (config.json + weights, a reduced draft
vocabulary with its d2t map) for a tiny Llama target; ``make_mimo`` a tiny MiMo checkpoint
(a Qwen2 decoder plus ``model.mtp_layers.0.*``). ``eagle3_reference`` / ``mtp_reference``
compute the drafts a head should propose for a token sequence from scratch: full causal
attention, no cache, the target's features from transformers (``output_hidden_states``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

H, HEADS, KV_HEADS, INTER = 64, 4, 2, 128
HEAD_DIM = H // HEADS
THETA = 10000.0
EPS = 1e-6


def _rand(gen: torch.Generator, *shape: int, scale: float = 0.2) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _layer_weights(gen: torch.Generator, prefix: str, in_size: int, bias: bool) -> dict:
    w = {
        f"{prefix}self_attn.q_proj.weight": _rand(gen, HEADS * HEAD_DIM, in_size),
        f"{prefix}self_attn.k_proj.weight": _rand(gen, KV_HEADS * HEAD_DIM, in_size),
        f"{prefix}self_attn.v_proj.weight": _rand(gen, KV_HEADS * HEAD_DIM, in_size),
        f"{prefix}self_attn.o_proj.weight": _rand(gen, H, HEADS * HEAD_DIM),
        f"{prefix}mlp.gate_proj.weight": _rand(gen, INTER, H),
        f"{prefix}mlp.up_proj.weight": _rand(gen, INTER, H),
        f"{prefix}mlp.down_proj.weight": _rand(gen, H, INTER),
        f"{prefix}input_layernorm.weight": 1 + _rand(gen, H, scale=0.1),
        f"{prefix}post_attention_layernorm.weight": 1 + _rand(gen, H, scale=0.1),
    }
    if bias:
        for p in ("q", "k", "v"):
            rows = w[f"{prefix}self_attn.{p}_proj.weight"].shape[0]
            w[f"{prefix}self_attn.{p}_proj.bias"] = _rand(gen, rows, scale=0.1)
    return w


# -- EAGLE-3 ------------------------------------------------------------------------------
def make_eagle3_head(
    path: Path, vocab_size: int, aux_layers: list[int], draft_vocab: int = 1024,
    seed: int = 0, own_embedding: bool = False, as_bin: bool = False,
) -> Path:  # fmt: skip
    """An EAGLE-3 head folder for a target of hidden size H and ``vocab_size`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    w = _layer_weights(gen, "midlayer.", 2 * H, bias=False)
    w["midlayer.hidden_norm.weight"] = 1 + _rand(gen, H, scale=0.1)
    w["fc.weight"] = _rand(gen, H, 3 * H, scale=0.1)
    w["norm.weight"] = 1 + _rand(gen, H, scale=0.1)
    w["lm_head.weight"] = _rand(gen, draft_vocab, H, scale=0.5)
    targets = torch.randperm(vocab_size, generator=gen)[:draft_vocab].sort().values
    w["d2t"] = targets - torch.arange(draft_vocab)  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[targets] = True
    w["t2d"] = t2d
    if own_embedding:
        w["embed_tokens.weight"] = _rand(gen, vocab_size, H, scale=1.0)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "rms_norm_eps": EPS,
        "rope_theta": THETA, "max_position_embeddings": 512, "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab, "hidden_act": "silu", "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layers},
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    if as_bin:
        torch.save(w, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    return path


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").exists():
        return load_file(str(folder / "model.safetensors"))
    return torch.load(folder / "pytorch_model.bin", weights_only=True)


def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated as Llama rotates (rotate_half)."""
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    f = positions.float()[:, None] * inv[None]
    cos, sin = (
        torch.cat((f.cos(), f.cos()), -1)[:, None],
        torch.cat((f.sin(), f.sin()), -1)[:, None],
    )
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _attention(w: dict, prefix: str, x: torch.Tensor, bias: bool) -> torch.Tensor:
    """Causal GQA self-attention over the whole sequence x [T, in]."""
    t = x.shape[0]

    def proj(name: str, heads: int) -> torch.Tensor:
        y = x @ w[f"{prefix}self_attn.{name}_proj.weight"].T
        if bias:
            y = y + w[f"{prefix}self_attn.{name}_proj.bias"]
        return y.view(t, heads, HEAD_DIM)

    pos = torch.arange(t)
    q, k, v = _rope(proj("q", HEADS), pos), _rope(proj("k", KV_HEADS), pos), proj("v", KV_HEADS)
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, HEADS * HEAD_DIM)
    return out @ w[f"{prefix}self_attn.o_proj.weight"].T


def _mlp(w: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate = x @ w[f"{prefix}mlp.gate_proj.weight"].T
    up = x @ w[f"{prefix}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}mlp.down_proj.weight"].T


def target_hidden_states(target, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' hidden states: [0] the embeddings, [i] the input of layer i, [L] the
    final (normed) output; each [m, H]."""
    with torch.no_grad():
        out = target(torch.tensor([tokens]), output_hidden_states=True)
    return tuple(h[0].float() for h in out.hidden_states)


def eagle3_reference(folder: Path, target, tokens: list[int], k: int) -> list[int]:
    """The k drafts an EAGLE-3 head proposes after ``tokens`` (all computed by the target)."""
    w, config = _weights(folder), json.loads((folder / "config.json").read_text())
    aux = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    hs = target_hidden_states(target, tokens)
    embed = w.get("embed_tokens.weight", target.model.embed_tokens.weight.detach())
    feats = torch.cat([hs[i] for i in aux], -1)[: len(tokens) - 1] @ w["fc.weight"].T
    ids = list(tokens[1:])
    drafts: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            e = embed[torch.tensor(ids)]
            x = torch.cat((_norm(e, w["midlayer.input_layernorm.weight"]),
                           _norm(feats, w["midlayer.hidden_norm.weight"])), -1)  # fmt: skip
            stream = feats + _attention(w, "midlayer.", x, bias=False)
            stream = stream + _mlp(
                w, "midlayer.", _norm(stream, w["midlayer.post_attention_layernorm.weight"])
            )
            logits = _norm(stream[-1], w["norm.weight"]) @ w["lm_head.weight"].T
            best = int(logits.argmax())
            token = best + int(w["d2t"][best])
            drafts.append(token)
            ids.append(token)
            feats = torch.cat((feats, stream[-1:]))
    return drafts


# -- MTP (MiMo) ---------------------------------------------------------------------------
def make_mimo(path: Path, tokenizer, seed: int = 0, num_layers: int = 2) -> Path:
    """A random Qwen2 saved as a MiMo checkpoint: architectures MiMoForCausalLM,
    num_nextn_predict_layers 1 and ``model.mtp_layers.0.*`` next to the decoder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=H, intermediate_size=INTER,
        num_hidden_layers=num_layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, initializer_range=0.2, rope_theta=THETA, rms_norm_eps=EPS,
    )  # fmt: skip
    Qwen2ForCausalLM(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    gen = torch.Generator().manual_seed(seed + 100)
    p = "model.mtp_layers.0."
    mtp = _layer_weights(gen, p, H, bias=True)
    mtp[f"{p}token_layernorm.weight"] = 1 + _rand(gen, H, scale=0.1)
    mtp[f"{p}hidden_layernorm.weight"] = 1 + _rand(gen, H, scale=0.1)
    mtp[f"{p}input_proj.weight"] = _rand(gen, H, 2 * H, scale=0.15)
    mtp[f"{p}final_layernorm.weight"] = 1 + _rand(gen, H, scale=0.1)
    weights = load_file(str(path / "model.safetensors"))
    save_file({**weights, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    return path


def mtp_reference(folder: Path, target, tokens: list[int], k: int) -> list[int]:
    """The k drafts MiMo's first MTP layer proposes after ``tokens``."""
    w = load_file(str(folder / "model.safetensors"))
    p = "model.mtp_layers.0."
    hs = target_hidden_states(target, tokens)
    feats = hs[-1][: len(tokens) - 1]  # the target's final (normed) hidden states
    embed, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    ids = list(tokens[1:])
    drafts: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            e = embed[torch.tensor(ids)].clone()
            e[0] = 0.0  # MiMo zeroes the embedding at position 0
            x = torch.cat((_norm(feats, w[f"{p}hidden_layernorm.weight"]),
                           _norm(e, w[f"{p}token_layernorm.weight"])), -1) @ w[f"{p}input_proj.weight"].T  # fmt: skip
            stream = x + _attention(w, p, _norm(x, w[f"{p}input_layernorm.weight"]), bias=True)
            stream = stream + _mlp(w, p, _norm(stream, w[f"{p}post_attention_layernorm.weight"]))
            out = _norm(stream, w[f"{p}final_layernorm.weight"])
            token = int((out[-1] @ head.T).argmax())
            drafts.append(token)
            ids.append(token)
            feats = torch.cat((feats, out[-1:]))
    return drafts
