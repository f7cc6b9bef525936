"""Offline prompts with media: ``{"prompt": ..., "multi_modal_data": {...},
"mm_processor_kwargs": {...}}`` -> placeholder-expanded ids and ``RequestOptions``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.request import RequestOptions
from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.encoder_budget import EncoderBudget
from tokenmill.multimodal.inputs import MultiModalInputs
from tokenmill.multimodal.media import MediaPolicy
from tokenmill.multimodal.model import multimodal_info
from tokenmill.multimodal.options import MediaOptions, parse_limits, parse_processor_kwargs
from tokenmill.multimodal.processing import (
    QwenVLProcessor,
    load_image_processor,
    load_video_config,
)


def build_processor(
    config: EngineConfig, model: Any, folder: Any, tokenizer: Any = None
) -> MediaProcessor | None:
    """The media processor of a model with an encoder (None: text only), by the model's
    ``MultiModalInfo.processor``."""
    info = multimodal_info(model)
    if info is None:
        return None
    limits = parse_limits(config.limit_mm_per_prompt)
    if info.processor == "qwen2_audio":
        from tokenmill.multimodal.audio import Qwen2AudioProcessor, load_feature_extractor

        return Qwen2AudioProcessor(info, load_feature_extractor(folder), limits)
    if info.processor == "gemma3":
        from tokenmill.multimodal.gemma3 import Gemma3Processor, load_gemma3_image_processor

        return Gemma3Processor(
            info, load_gemma3_image_processor(folder), tokenizer, limits,
            config.media_max_pixels, max_prefill_chunk(config),
        )  # fmt: skip
    if info.processor in ("smolvlm", "idefics3"):
        from tokenmill.multimodal.idefics3 import Idefics3Processor, load_idefics3_image_processor

        image_processor = load_idefics3_image_processor(folder, info.processor)
        return Idefics3Processor(
            info, image_processor, tokenizer, limits, config.media_max_pixels,
            parse_processor_kwargs(config.mm_processor_kwargs),
        )  # fmt: skip
    if info.processor == "qwen3_vl":
        from tokenmill.multimodal.qwen3_video import QWEN3_VIDEO
        from tokenmill.multimodal.qwen3_vl import Qwen3VLProcessor

        return Qwen3VLProcessor(
            info, load_image_processor(folder), parse_processor_kwargs(config.mm_processor_kwargs),
            limits, config.media_max_pixels, load_video_config(folder, QWEN3_VIDEO),
            config.max_visual_tokens_per_prompt, tokenizer=tokenizer,
        )  # fmt: skip
    return QwenVLProcessor(
        info,
        load_image_processor(folder),
        parse_processor_kwargs(config.mm_processor_kwargs),
        limits,
        config.media_max_pixels,
        load_video_config(folder),
        config.max_visual_tokens_per_prompt,
    )


class MediaProcessor(Protocol):
    """Turns one prompt's media into placeholder runs (``QwenVLProcessor``,
    ``idefics3.Idefics3Processor``)."""

    defaults: MediaOptions
    preprocess_seconds: float
    items_processed: int

    def process(
        self, prompt_ids: list[int], data: Mapping[str, Any], options: MediaOptions
    ) -> tuple[list[int], MultiModalInputs]: ...


def max_prefill_chunk(config: EngineConfig) -> int:
    """The most prompt tokens of one request a step can take."""
    budget = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
    cap = config.long_prefill_token_threshold
    return min(budget, cap) if cap else budget


def model_name(config: EngineConfig) -> str:
    return config.served_model_name or str(config.model)


def no_encoder_error(config: EngineConfig) -> InvalidRequestError:
    return InvalidRequestError(
        f"model {model_name(config)!r} has no vision or audio encoder: it takes text only, "
        "so multi_modal_data and media content parts can not be used with it"
    )


def attach_media(
    processor: MediaProcessor | None,
    config: EngineConfig,
    prompts: Any,
    items: list[tuple[str | None, list[int]]],
    options: list[RequestOptions],
) -> tuple[list[tuple[str | None, list[int]]], list[RequestOptions]]:
    """Process the media of dict prompts that carry ``multi_modal_data``; other prompts
    pass through unchanged (a text-only batch costs one dict lookup per prompt)."""
    seq: Sequence[Any] = prompts if isinstance(prompts, list) else [prompts]
    if len(seq) != len(items):  # a single token-id list prompt
        seq = [prompts]
    out_items, out_opts = list(items), list(options)
    for k, p in enumerate(seq):
        if not isinstance(p, dict) or not (
            p.get("multi_modal_data") or p.get("mm_processor_kwargs")
        ):
            continue
        if processor is None:
            raise no_encoder_error(config)
        data = p.get("multi_modal_data") or {}
        if not isinstance(data, dict):
            raise InvalidRequestError("multi_modal_data must be a dict like {'image': image}")
        opts = parse_processor_kwargs(p.get("mm_processor_kwargs"))
        ids, mm = processor.process(items[k][1], data, opts)
        out_items[k] = (items[k][0], ids)
        out_opts[k] = dataclasses.replace(options[k], multimodal=mm)
    return out_items, out_opts


def chat_media(
    messages: list[dict], config: EngineConfig, processor: MediaProcessor | None
) -> tuple[list[dict], dict[str, Any]]:
    """(messages for the template, extra prompt keys): ``{"multi_modal_data": {"image":
    [...]}}`` when the conversation has image parts, else {}."""
    from tokenmill.multimodal.chat import extract_media, has_media

    if not has_media(messages):
        return messages, {}
    if processor is None:
        raise no_encoder_error(config)
    messages, media = extract_media(messages, media_policy(config))
    return messages, {"multi_modal_data": media}


def multimodal_metrics(processor: MediaProcessor | None, step: Any) -> dict[str, float | int]:
    """Encoder and preprocessing counters (``LLM.get_multimodal_metrics``)."""
    out: dict[str, float | int] = {}
    if processor is not None:
        out["mm_preprocess_seconds"] = processor.preprocess_seconds
        out["mm_items_processed"] = processor.items_processed
    if step is not None:
        s = step.stats
        out.update(
            mm_items_encoded_or_cached=s.items, mm_encoder_runs=s.encoder_runs,
            mm_encoder_cache_hits=s.cache_hits, mm_encoder_seconds=s.encoder_seconds,
            mm_encoder_cache_evictions=s.evictions, mm_encoder_cache_entries=len(step.cache),
            mm_encoder_cache_bytes=step.cache.used,
        )  # fmt: skip
    return out


def media_policy(config: EngineConfig) -> MediaPolicy:
    """Where chat media may come from, from the engine options."""
    return MediaPolicy(
        allowed_local_media_path=config.allowed_local_media_path,
        allow_http=config.allow_media_fetch,
        max_bytes=config.media_max_bytes,
        timeout=config.media_fetch_timeout,
        max_pixels=config.media_max_pixels,
    )


def encoder_budget(config: EngineConfig, scheduler: Any) -> EncoderBudget:
    """The scheduler's per-step encoder budget: ``max_num_encoder_input_tokens`` (vLLM's
    name), by default the step's token budget."""
    return EncoderBudget(config.max_num_encoder_input_tokens or scheduler.max_num_batched_tokens)
