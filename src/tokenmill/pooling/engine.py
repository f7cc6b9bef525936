"""``PoolingEngine``: a loaded pooling model, from prompts to finished tensors.

Stages: ``prepare`` (validate + tokenize; any thread), ``run`` (the model; one thread at
a time), ``finish`` (per-request dimensions / normalize / activation). The offline API
calls them in a row; the server tokenizes off the loop and batches ``run`` across
requests on its engine thread (``frontend.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.config import EngineConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.loader.checkpoint import Checkpoint
from tokenmill.metrics.stats import EngineStats
from tokenmill.models.registry import resolve_pooling_class
from tokenmill.pooling.causal import CausalPoolingModel
from tokenmill.pooling.params import PoolingParams
from tokenmill.pooling.pooler import Pooler, check_dimensions, finish_embedding, finish_logits
from tokenmill.pooling.quantize import quantize_int8, resolve_pooling_quantization
from tokenmill.pooling.runner import PoolingRunner
from tokenmill.pooling.task import PoolingPlan
from tokenmill.pooling.tokenize import Encoded, PoolingTokenizer
from tokenmill.tokenizer.tokenizer import load_tokenizer

Prompt = str | Sequence[int]
"""A text, or token ids to use as they are."""
# task -> what the runner returns for it
RUN_KIND = {
    "embed": "pooled",
    "token_embed": "tokens",
    "classify": "logits",
    "score": "logits",
    "token_classify": "token_logits",
}
DEFAULT_TOKEN_BUDGET = 16384
"""Padded tokens per forward pass when max_num_batched_tokens is unset (measured on 2
CPU cores: larger batches gain nothing, smaller ones lose at short inputs)."""


@dataclass(frozen=True)
class _Loaded:
    """The part of ``LLMEngine.loaded`` that callers read (generation defaults)."""

    checkpoint: Checkpoint


class _NoKVCache:
    """Pooling holds no KV cache: the metrics read 0."""

    usage = 0.0


class PoolingEngine:
    mm_processor = None
    """Pooling models take no media (``LLMEngine.mm_processor``)."""

    def __init__(self, config: EngineConfig, plan: PoolingPlan) -> None:
        if config.parallel.world_size > 1 or config.parallel.data_parallel_size > 1:
            raise ValueError(
                f"{config.parallel}: pooling models (embed / score / classify) run in one "
                "process; tensor, pipeline and data parallelism are for generation models"
            )
        self.config = config
        self.plan = plan
        self.loaded = _Loaded(plan.checkpoint)
        self.kv = _NoKVCache()
        self.stats = EngineStats()
        device, dtype = config.torch_device(), config.torch_dtype()
        self.tokenizer = load_tokenizer(plan.checkpoint, config.tokenizer)
        self.model = self._build_model(device, dtype)
        model = self.model
        self.pooler = Pooler(plan.pooler, dtype).to(device)
        limits = [model.max_positions, plan.pooler.max_seq_length, config.max_model_len]
        self.max_model_len = min(n for n in limits if n)
        self.text = PoolingTokenizer(self.tokenizer.hf, self.max_model_len)
        budget = config.max_num_batched_tokens or max(DEFAULT_TOKEN_BUDGET, self.max_model_len)
        self.runner = PoolingRunner(self.model, self.pooler, device, budget, config.max_num_seqs)

    def _build_model(self, device: torch.device, dtype: torch.dtype) -> Any:
        """Built on the meta device (encoders) or in place (decoder stacks), then loaded once."""
        plan, hf_config = self.plan, self.plan.checkpoint.hf_config
        if plan.causal:
            resolve_pooling_quantization(
                self.config.quantization, self.config.dtype, device, CausalPoolingModel, True
            )
            tokens = plan.pooler.classifier_from_token
            ids = None if tokens is None else self._token_ids(tokens)
            weights = plan.checkpoint.weights(dtype)
            return CausalPoolingModel.build(
                plan.architecture, hf_config, weights, dtype, device, ids
            )
        cls = resolve_pooling_class(plan.architecture)
        quant = resolve_pooling_quantization(
            self.config.quantization, self.config.dtype, device, cls, plan.causal
        )
        if getattr(cls, "builds_in_place", False):  # decoder stacks: rotary tables at init
            with torch.device(device):
                model = cls(hf_config, dtype)
            model.load_weights(plan.checkpoint.weights(dtype))
            return model.eval()
        with torch.device("meta"):
            model = cls(hf_config)
        model = model.to_empty(device=device).to(dtype)
        model.load_weights(plan.checkpoint.weights(dtype))
        if quant == "int8":
            quantize_int8(model)
        return model.eval()

    def _token_ids(self, tokens: tuple[str, str]) -> tuple[int, int]:
        hf = self.tokenizer.hf
        ids = [hf.convert_tokens_to_ids(t) for t in tokens]
        if any(i is None or i == hf.unk_token_id for i in ids):
            raise InvalidRequestError(
                f"classifier_from_token {list(tokens)}: not single tokens of this vocabulary"
            )
        return int(ids[0]), int(ids[1])  # type: ignore[arg-type]

    # -- what the model serves ----------------------------------------------------------
    @property
    def task(self) -> str:
        return self.plan.task

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.plan.supported_tasks

    def check_task(self, task: str) -> None:
        if task not in self.supported_tasks:
            raise InvalidRequestError(
                f"this model ({self.plan.architecture}, convert={self.plan.convert!r}) does not "
                f"support the {task!r} task; it supports {', '.join(self.supported_tasks)}"
                + _hint(task)
            )

    # -- stages ---------------------------------------------------------------------------
    def prepare(self, prompts: Sequence[Prompt], params: PoolingParams, task: str) -> list[Encoded]:
        """Validate and tokenize one request's prompts (any thread)."""
        self.check_task(task)
        if not prompts:
            raise InvalidRequestError("the input list is empty; send at least one input")
        if task == "embed":
            check_dimensions(params, self.plan.pooler, self.embedding_size)
        truncate = params.truncate_prompt_tokens
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(self.text.encode(self._with_prompt(texts), truncate) if texts else [])
        return [
            next(encoded) if isinstance(p, str) else self.text.from_ids(p, truncate)
            for p in prompts
        ]

    def prepare_pairs(
        self, firsts: Sequence[str], seconds: Sequence[str], truncate: int | None
    ) -> list[Encoded]:
        """(query, document) pairs for a cross-encoder."""
        return self.text.encode_pairs(firsts, seconds, truncate)

    def run(self, inputs: Sequence[Encoded], task: str) -> list[torch.Tensor]:
        """The model over encoded inputs (one thread at a time)."""
        return self.runner.run(inputs, RUN_KIND[task]).tensors

    def finish(self, raw: torch.Tensor, params: PoolingParams, task: str) -> torch.Tensor:
        if task == "embed":
            return finish_embedding(raw, params, self.plan.pooler)
        if task == "token_embed":
            return F.normalize(raw, dim=-1) if params.normalize else raw
        return finish_logits(raw, params, self.plan.pooler)

    # -- what the generation engine's callers also ask -------------------------------------
    @property
    def embedding_size(self) -> int:
        dense = self.plan.pooler.dense
        return dense[-1].out_features if dense else self.model.hidden_size

    def add_request(self, *args: Any, **kwargs: Any) -> str:
        raise InvalidRequestError(
            f"this model is loaded as a pooling model (task {self.task!r}): it can not "
            "generate text; use llm.embed / llm.score / llm.classify / llm.encode, or load "
            "it with runner='generate' if it is a generative model"
        )

    def live_request_ids(self) -> list[str]:
        return []

    def abort(self, request_id: str) -> None:
        """Nothing runs in the background offline."""

    def shutdown(self) -> None:
        """No workers: the model is released with the engine."""

    def prefix_cache_metrics(self) -> dict[str, int | float]:
        return {}

    def reset_prefix_cache(self) -> int:
        return 0

    def _with_prompt(self, texts: list[str]) -> list[str]:
        """sentence-transformers' default prompt (config_sentence_transformers.json)."""
        cfg = self.plan.pooler
        prefix = cfg.prompts.get(cfg.default_prompt_name or "", "")
        return [prefix + t for t in texts] if prefix else texts


def _hint(task: str) -> str:
    if task in ("embed", "token_embed"):
        return "; load an embedding model, or this one with convert='embed'"
    if task == "classify":
        return "; load a *ForSequenceClassification checkpoint"
    if task == "token_classify":
        return "; load a *ForTokenClassification checkpoint"
    return "; score needs an embedding model or a one-label classifier (cross-encoder)"
