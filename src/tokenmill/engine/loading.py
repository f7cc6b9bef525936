"""Checkpoint -> ready model, tokenizer and limits. Options are checked before weights are read."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.config import EngineConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.kv_cache.spec import FullAttention, bytes_per_block
from tokenmill.layers.ops import Ops, select_ops
from tokenmill.loader import Checkpoint, load_checkpoint
from tokenmill.models import resolve_model_class
from tokenmill.models.base import CausalLM
from tokenmill.native.dense16 import fp32_native
from tokenmill.quant.dense16 import move_float32_to_native
from tokenmill.quant.plan import (
    FLOAT_FORMATS,
    NATIVE_FP32,
    auto_dtype,
    build_plan,
    resolve_quantization,
    stored_float_dtype,
)
from tokenmill.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from tokenmill.distributed.part import ModelPart

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    checkpoint: Checkpoint
    model: CausalLM
    tokenizer: Tokenizer
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    quantization: str = "none"
    """The resolved weight format (``EngineConfig.quantization`` with auto decided)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per start-up phase of this load (``bundles.phases``), in order."""


def model_context_limit(hf_config: dict) -> int:
    """The checkpoint's own context length; a multimodal config keeps it in its
    ``text_config`` (Qwen3.5's vision checkpoints)."""
    for config in (hf_config, hf_config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
            if config.get(key):
                return int(config[key])
    return 2048


def resolve_max_model_len(config: EngineConfig, hf_config: dict) -> int:
    limit = model_context_limit(hf_config)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise InvalidRequestError(
            f"max_model_len={config.max_model_len} is longer than the model's own limit "
            f"({limit} tokens); use at most {limit}"
        )
    return config.max_model_len


def load_model(config: EngineConfig, shard: ModelPart | None = None) -> LoadedModel:
    """The ready model of ``config``: from its prepared bundle when ``prepare_bundle`` is on
    (``tokenmill.bundles``; a bundle folder passed as the model is always one), else built.
    ``shard``: build and load only this rank's part: a tensor-parallel shard or a pipeline
    stage (``tokenmill.distributed``; never from a bundle)."""
    from tokenmill.bundles.cache import BundleCache, is_bundle

    if shard is not None:
        return _build_model(config, shard)

    if is_bundle(config.model):
        return _warm(BundleCache.for_config(config).load_pinned(config))
    if config.prepare_bundle and config.torch_device().type == "cpu":
        try:
            cache = BundleCache.for_config(config)
        except OSError as e:  # a read-only home, a cache_dir that is a file: start cold
            logger.warning("prepared bundles are off for this start: %s", e)
            return _build_model(config)
        loaded = cache.load_or_build(config, _build_model)
        return loaded if isinstance(loaded, LoadedModel) else _warm(loaded)
    return _build_model(config)


def _warm(prepared: tuple) -> LoadedModel:
    """A model mapped from its bundle (``bundles.store.Prepared``), its kernels logged as a
    cold load logs them."""
    loaded = LoadedModel(*prepared)
    _log_kernels(loaded.model.ops)
    return loaded


def _log_kernels(ops: Ops) -> None:
    logger.info("attention backend %s, layer kernels %s, recurrent scans %s",
                ops.backend.name, ops.kernels.name, ops.scan.name)  # fmt: skip


def _build_model(config: EngineConfig, shard: ModelPart | None = None) -> LoadedModel:
    from tokenmill.bundles.phases import Phases

    phases = Phases()
    with phases("resolve"):
        ckpt = load_checkpoint(config.model)
        model_cls = resolve_model_class(ckpt.hf_config.get("architectures"))
        max_model_len = resolve_max_model_len(config, ckpt.hf_config)
        device = config.torch_device()
        auto_hf = config.quantization == "auto" and ckpt.format == "hf"
        # a 16-bit HF checkpoint stays 16-bit
        stored = stored_float_dtype(ckpt) if auto_hf else None
        quantization = resolve_quantization(config.quantization, config.dtype, device, ckpt.format,
                                            stored)  # fmt: skip
        if (
            auto_hf
            and quantization in FLOAT_FORMATS
            and not getattr(model_cls, "takes_quant_plan", True)
        ):
            quantization = "none"  # its layers are dense only: weights in the model dtype
        types = _stored_types(ckpt) if quantization == "gguf" else {}
        plan = build_plan(quantization, types if shard is None else shard.stored_types(types),
                          config.activation_precision)  # fmt: skip
        dtype = auto_dtype() if plan and config.dtype == "auto" else config.torch_dtype()
    with phases("tokenizer"):
        tokenizer = load_tokenizer(ckpt, config.tokenizer)
    logger.info(
        "building %s (%s, %s, weights %s%s) from %s",
        model_cls.__name__,
        dtype,
        device,
        quantization,
        ", activation_precision low: one activation term"
        if plan and plan.activation_terms == 1
        else "",
        ckpt.path,
    )
    with phases("kernels"):
        ops = select_ops(device, dtype, plan, config.attention_backend)  # every layer's kernels
    _log_kernels(ops)
    with phases("weights"):
        with torch.device(device):  # parameters are created in place: no second copy
            kwargs = {"quant": plan} if plan else {}
            hf = ckpt.hf_config if shard is None else shard.local_hf_config(ckpt.hf_config)
            model = model_cls(hf, dtype, max_positions=max_model_len, ops=ops, **kwargs)
        if shard is not None:
            shard.adopt(model)  # parallel layers; a stage drops what it never runs
        # too small a KV cache fails before the read
        _kv_blocks(config, model, dtype, max_model_len)
        weights = ckpt.weights(dtype, keep_quantized=plan is not None)
        model.load_weights(weights if shard is None else shard.weights(weights))
        if _native_float32_after_load(quantization, device, ckpt.format, shard):
            moved = move_float32_to_native(model, planned=bool(plan))
            logger.info("%d float32 layers moved to the native float32 kernel", moved)
        model.eval()
    phases.log(f"model ready (cold load of {ckpt.path})")
    return LoadedModel(
        ckpt, model, tokenizer, max_model_len, dtype, device, quantization, phases.seconds
    )


def _native_float32_after_load(
    quantization: str, device: torch.device, fmt: str, shard: ModelPart | None
) -> bool:
    """The native float32 kernel runs float32 weights on this CPU (``fp32_native``,
    ``TOKENMILL_FP32_GEMM``), for an HF folder loaded whole in this process, and the
    weights are float32: either dense (``none``: the models that build no quantization
    plan, the hybrids) or in its plan (``fp32``, ``quant/plan.py: NATIVE_FP32``), whose
    towers are still ``nn.Linear`` layers. Dense weights of other dtypes are skipped. Not
    for TP / PP shards (their parallel layers own their weights; their plan's linears
    take the kernel) nor dequantized GGUF files (kept as PyTorch loads them, the
    reference the bundles and parity tests hold them to)."""
    if device.type != "cpu" or quantization not in ("none", NATIVE_FP32):
        return False
    if fmt != "hf" or shard is not None:
        return False
    return fp32_native()


def _stored_types(ckpt: Checkpoint) -> dict:
    """HF tensor name -> GGML type, for a GGUF checkpoint."""
    types = getattr(ckpt.source, "tensor_types", None)  # GGUF sources only
    return types() if types is not None else {}


def kv_cache_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """How many KV blocks to allocate; the cache must hold one max_model_len sequence."""
    return _kv_blocks(config, loaded.model, loaded.dtype, loaded.max_model_len)


def _kv_blocks(config: EngineConfig, m: CausalLM, dtype: torch.dtype, max_model_len: int) -> int:
    # What one block costs over the paged layers the model declares (a hybrid's recurrent
    # layers hold no blocks), its K/V in ``dtype``.
    specs = [dataclasses.replace(s, dtype=dtype) if isinstance(s, FullAttention) else s
             for s in m.cache_specs()]  # fmt: skip
    block_bytes = bytes_per_block(specs, config.block_size)
    one_seq = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif block_bytes == 0:  # no paged layer (a pure state-space model): blocks cost nothing
        return one_seq * config.max_num_seqs
    elif config.kv_cache_memory_bytes is not None:
        blocks = config.kv_cache_memory_bytes // block_bytes
    else:
        return max((1 << 30) // block_bytes, one_seq)
    if blocks < one_seq:
        raise InvalidRequestError(
            f"the KV cache ({blocks} blocks of {config.block_size} tokens) can not hold one "
            f"sequence of max_model_len={max_model_len} tokens ({one_seq} blocks): "
            "lower max_model_len or give the KV cache more memory"
        )
    return blocks
