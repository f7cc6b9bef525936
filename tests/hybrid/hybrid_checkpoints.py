"""Tiny random hybrid checkpoints and transformers' greedy reference (importable as
``hybrid_checkpoints`` from tests/hybrid)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 4096
"""The first ids of the SmolLM2 tokenizer: a small output head keeps the tests fast."""
EOS = 2
"""The eos id of every config here (and of the SmolLM2 tokenizer)."""


def randomize(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Every parameter drawn at random (HF inits norms to 0/1 and decays to constants, which
    would leave paths untested); weights large enough that greedy choices are clear-cut."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)  # decays exp(A) in (0.4, 2.7)
            elif name.endswith("dt_bias"):
                p.copy_(noise * 0.5)
            elif "norm" in name:
                p.copy_((1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + 0.1 * noise)
            else:
                p.copy_(noise * std)


def make_qwen3_5(path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A 4-layer Qwen3.5 (three Gated DeltaNet layers, then gated full attention) with the
    SmolLM2 tokenizer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    cfg.update(overrides)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@torch.no_grad()
def hf_greedy(
    path: Path, prompts: list[list[int]], steps: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: transformers' greedy tokens (its own cache) and their log-probs [steps]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = torch.stack([
            torch.log_softmax(step_logits[0].float(), -1)[t] for step_logits, t in zip(out.logits, tokens)
        ])  # fmt: skip
        results.append((tokens, logprobs))
    return results


@torch.no_grad()
def hf_teacher_forced(
    model, prompt: list[int], tokens: list[int]
) -> tuple[list[int], torch.Tensor]:
    """One transformers forward over prompt + tokens (no cache): its greedy choice after
    each prefix that ends before a token, and the log-probs of ``tokens`` [len(tokens)]."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [n, vocab]
    logprobs = torch.log_softmax(logits, -1)
    choice = logits.clone()
    choice[:, EOS] = float("-inf")  # banned, as min_tokens bans it in ``tokenmill_greedy``
    return choice.argmax(-1).tolist(), logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]


def tokenmill_greedy(
    llm, prompts: list[list[int]], steps: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: the engine's greedy tokens and their log-probs [steps]."""
    from tokenmill import SamplingParams
    from tokenmill.inputs import TokensPrompt

    # min_tokens: EOS is banned as transformers' min_new_tokens bans it in ``hf_greedy``.
    params = SamplingParams(
        temperature=0, max_tokens=steps, min_tokens=steps, ignore_eos=True, logprobs=1
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    results = []
    for out in outs:
        c = out.outputs[0]
        lp = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
        results.append((list(c.token_ids), lp))
    return results


def make_qwen3_5_vl(path: Path, tokenizer, seed: int = 0) -> Path:
    """The same text model inside a Qwen3.5 vision-language checkpoint (a 1-block vision
    tower: one process loads it, TP / PP ranks build without it), the output head tied at
    the top level as in Qwen3.5-0.8B (its text_config says untied)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_mamba2(path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A 4-layer Mamba2 (8 heads of 16 in 2 groups, state 16) with the SmolLM2 tokenizer."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, expand=2,
        state_size=16, n_groups=2, num_hidden_layers=4, conv_kernel=4, chunk_size=16,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        time_step_limit=(0.0, 100.0),  # the default (0, inf) does not survive config.json
    )  # fmt: skip
    cfg.update(overrides)
    model = Mamba2ForCausalLM(Mamba2Config(**cfg)).eval()
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)  # seeded: the global RNG depends on what ran
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.D.normal_(generator=gen)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hybrid_llm(path: Path, **options):
    """``tokenmill.LLM`` in float32 on CPU with small test defaults and integrity checks."""
    from tokenmill import LLM

    options = {"max_model_len": 128, "num_kv_blocks": 64, "block_size": 4,
               "check_kv_integrity": True, **options}  # fmt: skip
    return LLM(str(path), dtype="float32", device="cpu", **options)


def random_prompts(n: int, seed: int = 0, longest: int = 40) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [
        [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, longest + 1))] for _ in range(n)
    ]


def assert_matches_hf(hf_model, prompts, results, steps: int, atol: float) -> None:
    """Each result (tokens, log-probs) is transformers' greedy continuation of its prompt."""
    for prompt, (tokens, logprobs) in zip(prompts, results):
        assert len(tokens) == steps
        hf_next, hf_logprobs = hf_teacher_forced(hf_model, prompt, tokens)
        assert hf_next == tokens, f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(logprobs, hf_logprobs, atol=atol, rtol=0)


def make_lfm2(path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A 6-layer LFM2 (conv, conv, attention, conv, conv, attention) with the SmolLM2
    tokenizer."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        conv_L_cache=3, conv_bias=True, full_attn_idxs=[2, 5], block_multiple_of=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    cfg.update(overrides)
    model = Lfm2ForCausalLM(Lfm2Config(**cfg)).eval()
    randomize(model, seed)
    with torch.no_grad():  # Llama-style norms (x * w): around 1, not 0
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_falcon_h1(path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A 4-layer Falcon-H1 (attention and a Mamba2 mixer in every layer) with muP
    multipliers away from 1, so folding them into the weights is checked."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=False,
        time_step_limit=(0.0, 100.0), embedding_multiplier=1.5, lm_head_multiplier=0.7,
        key_multiplier=0.8, attention_in_multiplier=1.2, attention_out_multiplier=0.9,
        ssm_in_multiplier=1.1, ssm_out_multiplier=0.6, mlp_multipliers=[1.3, 0.8],
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    cfg.update(overrides)
    model = FalconH1ForCausalLM(FalconH1Config(**cfg)).eval()
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)  # seeded: the global RNG depends on what ran
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Llama-style norms (x * w): around 1, not 0
                p.add_(1.0)
            elif name.endswith(".D"):
                p.normal_(generator=gen)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_qwen3_next_dense(path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A 4-layer Qwen3-Next with dense MLPs (no experts), 2 value heads per key head."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        max_position_embeddings=512, num_experts=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    cfg.update(overrides)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**cfg)).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def narrow_head(path: Path, ids: list[int], scale: float = 3.0) -> Path:
    """Zero every output row but ``ids`` (those scaled up): greedy output stays inside a
    few tokens, so it repeats and prompt lookup both proposes and misses drafts, while
    which of them comes next still depends on the whole recurrent state."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    weights = load_file(file)
    head = weights["lm_head.weight"]
    kept = head[ids].clone() * scale
    head.zero_()
    head[ids] = kept
    save_file(weights, file, metadata={"format": "pt"})
    return path
