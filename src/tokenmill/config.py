"""Engine options: one frozen dataclass, validated before any weight is read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output.backend import BACKEND_CHOICES

if TYPE_CHECKING:
    from tokenmill.distributed.config import ParallelConfig
    from tokenmill.kv_cache.snapshots import ContextCacheConfig
    from tokenmill.spec_decode.config import SpeculativeConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
ASYNC_SCHEDULING = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """HF checkpoint folder or .gguf file; None = the embedded SmolLM2-135M-Instruct."""
    tokenizer: str | None = None
    """HF tokenizer folder overriding the checkpoint's own tokenizer."""
    dtype: str = "auto"
    """Compute and KV dtype: auto (float32 on CPU, bfloat16 on CUDA; with quantized weights
    see ``quantization``; on CPU a bfloat16/float16 HF checkpoint keeps its 16-bit weights
    with float32 compute), float32, bfloat16, float16."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    attention_backend: str = "auto"
    """Paged attention kernels (``tokenmill.attention.backends``): auto (triton on CUDA when
    it is installed; native for quantized weights computing in float32 on CPU; else
    reference), reference (pure PyTorch, any device), triton (CUDA; on CPU only under
    TRITON_INTERPRET=1, for tests), native (CPU C kernels, float32 activations only)."""
    quantization: str = "auto"
    """Weight format of the linear layers (``tokenmill.quant.plan.QUANTIZATIONS``): none
    (dense in dtype), gguf (a GGUF's 4-bit blocks as int4 groups, its other quantized
    types as int8 groups), int8, int4. auto = gguf on CPU for a GGUF checkpoint unless
    dtype is float32 or float16 (exact dequantized math), else none. With quantized
    weights dtype=auto means float32 where the native kernel runs, else bfloat16."""
    activation_precision: str = "high"
    """How the CPU int4/int8 kernels (GGUF, quantization=int8/int4) quantize activations
    (``tokenmill.quant.plan.ACTIVATION_PRECISIONS``): high (two int8 terms per group of 32,
    ~15 bits) or low (one int8 term, as llama.cpp: faster multi-token steps, a measured
    quality cost). low on any other weights is an error."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; may only lower the model's own limit."""
    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step; default max(2048, max_num_seqs)."""
    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_memory_bytes: int | None = None
    """Memory for the KV cache; default 1 GiB, raised to hold one max_model_len sequence."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks (overrides kv_cache_memory_bytes; tests use tiny caches)."""
    seed: int = 0
    """Seed of the generator used by requests that set no seed of their own."""
    max_logprobs: int = 20
    """Most logprobs / prompt_logprobs alternatives a request may ask for."""
    served_model_name: str | None = None
    """Model name reported in outputs and by the server; default: the path's name."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks shared with earlier requests (same tokens from the start)."""
    ssm_state_cache_size: int | None = None
    """Hybrid and state-space models: the number of recurrent-state slots (one per running
    request; a request waits, or is preempted and later recomputed, while none is free).
    None: sized by ``ssm_full_memory_ratio``. Not together with it."""
    ssm_full_memory_ratio: float | None = None
    """Hybrid models: state-slot memory : full-attention KV memory = r : 1 (None means
    1.0), at most ``max_num_seqs`` slots (more could not be used); a model with no
    attention layer gets ``max_num_seqs`` slots. Not together with ``ssm_state_cache_size``."""
    context_cache_config: dict[str, Any] | None = None
    """How hybrid and state-space models' prompts are kept for reuse (prefix caching):
    {"recurrent_snapshot_pool_bytes": n}, the byte budget of recurrent-state snapshots
    (``kv_cache/snapshots.py``: at every 64 tokens and at every prompt's end, least
    recently used evicted; 0: none, such a model then reuses no prefix; default: as many
    bytes as the state slots)."""
    recurrent_snapshot_pool_bytes: int | None = None
    """Flat form of ``context_cache_config["recurrent_snapshot_pool_bytes"]``."""
    context_cache: ContextCacheConfig = field(init=False, compare=False, repr=False)
    """The resolved context-cache options (from the two fields above)."""
    long_prefill_token_threshold: int | None = None
    """Largest prefill chunk of one request per step, so long prompts never stall decodes
    for a whole budget's worth of compute (None: up to max_num_batched_tokens)."""
    enforce_eager: bool = False
    """Never use CUDA graphs (vLLM's name). By default an all-decode step on CUDA replays a
    graph captured per batch-size bucket when the attention backend supports capture;
    graphs are captured once at start-up and cut the per-kernel launch cost of decoding."""
    async_scheduling: str = "auto"
    """Schedule and launch each step while the previous one still runs on the device, so
    the host's per-step work (scheduling, inputs, outputs) hides behind the GPU's: on,
    off, or auto (on for CUDA). Steps of requests whose sampling reads the tokens so far
    (structured output, penalties, min_tokens) run synchronously. Outputs are the same
    either way; a request that stops early costs one discarded token of compute."""
    check_kv_integrity: bool = False
    """Debug: verify the KV block bookkeeping after every step (slow)."""
    structured_outputs_backend: str = "auto"
    """Grammar backend of structured output: auto (the first installed) or guidance (llguidance)."""
    reasoning_parser: str = "auto"
    """How reasoning is delimited (e.g. think: <think>...</think>); structured output then
    constrains only the answer after it. auto: chosen from the chat template; none: off."""
    # -- speculative decoding (``spec_decode/``) -------------------------------------------
    speculative_config: Any = None
    """vLLM's dict (or a ``spec_decode.SpeculativeConfig``): ``method`` (ngram, suffix,
    draft_model), ``num_speculative_tokens``, ``model`` (the draft), ``prompt_lookup_min``
    / ``prompt_lookup_max``, ``suffix_decoding_*``. None: no speculation."""
    speculative_method: str | None = None
    """Flat form of ``speculative_config["method"]`` (not together with the dict)."""
    draft_model_id_or_path: str | None = None
    """Flat form of ``speculative_config["model"]``."""
    num_speculative_tokens: int | None = None
    """Flat form of ``speculative_config["num_speculative_tokens"]``."""
    draft_top_k: int | None = None
    """Draft trees: guesses per position (``speculative_config["draft_top_k"]``)."""
    draft_step: int | None = None
    """Draft trees: their depth (= num_speculative_tokens)."""
    verify_tree_size: int | None = None
    """Draft trees: most nodes verified per request per step."""
    max_verify_tree_size: int | None = None
    """Draft trees: the bound verify_tree_size may not pass."""
    speculative: SpeculativeConfig | None = field(init=False, default=None, compare=False)
    """The resolved speculative config (from the fields above), None when off."""
    # -- multimodal input (``multimodal/``) ----------------------------------------------
    limit_mm_per_prompt: dict[str, Any] | None = None
    """Most media items per prompt by modality, e.g. {"image": 4} (vLLM's name); default
    8 images (video and audio are not taken yet)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Processor options for every request (min_pixels / max_pixels, fps / nframes; top level
    or in images_kwargs / videos_kwargs); a request's own ``mm_processor_kwargs`` override them."""
    max_visual_tokens_per_prompt: int | None = None
    """Placeholder tokens one prompt's images and videos may take together: images first,
    videos share the rest (fewer frames are sampled to fit); None: no budget."""
    mm_encoder_cache_bytes: int = 256 << 20
    """Byte budget of the encoder cache (media embeddings by content hash, shared)."""
    max_num_encoder_input_tokens: int | None = None
    """Media tokens one step may encode (the first item of a step always may); None: the
    step's token budget. Keeps text-only requests from waiting behind image encoders."""
    allowed_local_media_path: str | None = None
    """``file://`` image URLs in chat messages must resolve inside this folder; None: off."""
    allow_media_fetch: bool = True
    """Fetch http(s) image URLs of chat messages (False: refused with a clear error)."""
    media_max_bytes: int = 20 << 20
    """Largest encoded media item (data URL, file or download)."""
    media_fetch_timeout: float = 10.0
    """Seconds one http(s) media fetch may take."""
    media_max_pixels: int = 64 << 20
    """Largest decoded image (width x height) accepted, before any resize."""
    # -- pooling models (``pooling/``) -----------------------------------------------------
    runner: str = "auto"
    """generate, pooling (embed / score / classify, ``tokenmill.pooling``), or auto:
    pooling for an encoder architecture or a sentence-transformers folder, else generate."""
    convert: str = "auto"
    """Pooling head: embed (a vector per input), classify (the checkpoint's classifier),
    or auto (classify for ``*ForSequenceClassification``, else embed). vLLM's name."""
    pooler_config: dict[str, Any] | None = None
    """Overrides of the checkpoint's pooling metadata: pooling_type (CLS, MEAN, LAST,
    MAX), normalize, activation / use_activation, dimensions (a Matryoshka default)."""
    # -- prepared-model bundles (``bundles/``) ---------------------------------------------
    prepare_bundle: bool = True
    """Keep a prepared bundle of the loaded model (final weights mapped from one file, the
    tokenizer, the resolved config) in ``cache_dir`` and start from it next time: a warm
    start maps the weights instead of reading, converting and repacking them, with the same
    logits bit for bit. CPU only (on CUDA the load is cold). False: every start is cold and
    nothing is written. No bundle is written for a model larger than
    ``engine_cache_max_size_gb``, one that would leave under 1 GiB of free disk, or a
    model with state a bundle can not restore; an unwritable ``cache_dir`` starts cold."""
    cache_dir: str | None = None
    """Folder of the prepared bundles; default ``$TOKENMILL_CACHE_DIR/bundles``
    (~/.cache/tokenmill/bundles)."""
    engine_cache_max_size_gb: float = 50.0
    """Size cap of ``cache_dir``: least recently used bundles not open in any process are
    removed after a new one is written until the rest fit."""
    clear_engine_cache: bool = False
    """Remove every bundle of ``cache_dir`` not open in a process before loading."""
    # -- scale-out (``distributed/``, ``docs/scale_out.md``) ---------------------------------
    tensor_parallel_size: int = 1
    """Ranks (processes, one device each) that split every layer of a decoder model: heads,
    MLP columns and vocabulary; the driver (this process) is rank 0."""
    pipeline_parallel_size: int = 1
    """Stages that split the layers (each a process; the last, with the sampler, is this
    one); with tensor_parallel_size too, each stage is that many ranks (tp x pp in all)."""
    distributed_executor_backend: str | None = None
    """How tensor / pipeline ranks run: mp (processes of this machine; the default) or ray
    (Ray actors on the cluster of ``ray_address``: ``distributed/ray_ranks.py``)."""
    data_parallel_size: int = 1
    """Engine replicas behind one server, each a Ray actor (``tokenmill[ray]``), requests
    routed by cached prefix (``distributed/router.py``); ``tokenmill serve`` only, not
    the offline ``LLM``."""
    ray_address: str | None = None
    """The Ray cluster the replicas join (``ray start --head`` prints it); None: start a
    local one."""
    data_parallel_routing: str = "cache_aware"
    """How the server picks a replica: cache_aware or round_robin."""
    parallel: ParallelConfig = field(init=False, compare=False, repr=False)
    """The resolved scale-out options (from the fields above)."""

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("block_size", self.block_size)
        if not self.engine_cache_max_size_gb >= 0:
            raise InvalidRequestError(
                f"engine_cache_max_size_gb must be >= 0, got {self.engine_cache_max_size_gb!r}"
            )
        from tokenmill.pooling.task import check_runner_options

        check_runner_options(self.runner, self.convert)
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "kv_cache_memory_bytes",
            "num_kv_blocks",
            "long_prefill_token_threshold",
            "ssm_state_cache_size",
        ):
            value = getattr(self, name)
            if value is not None:
                _check_positive(name, value)
        self._check_state_pool()
        from tokenmill.kv_cache.snapshots import ContextCacheConfig

        context = ContextCacheConfig.parse(
            self.context_cache_config, self.recurrent_snapshot_pool_bytes
        )
        object.__setattr__(self, "context_cache", context)  # derived once, here
        from tokenmill.multimodal.options import parse_limits, parse_processor_kwargs

        parse_limits(self.limit_mm_per_prompt)
        parse_processor_kwargs(self.mm_processor_kwargs)
        for name in ("mm_encoder_cache_bytes", "media_max_bytes", "media_max_pixels"):
            _check_positive(name, getattr(self, name))
        if self.max_visual_tokens_per_prompt is not None:
            _check_positive("max_visual_tokens_per_prompt", self.max_visual_tokens_per_prompt)
        if self.max_num_encoder_input_tokens is not None:
            _check_positive("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens)
        if not self.media_fetch_timeout > 0:
            raise InvalidRequestError(
                f"media_fetch_timeout must be > 0, got {self.media_fetch_timeout!r}"
            )
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise InvalidRequestError(
                f"async_scheduling={self.async_scheduling!r} is unknown; use one of "
                f"{', '.join(ASYNC_SCHEDULING)}"
            )
        if self.structured_outputs_backend not in BACKEND_CHOICES:
            raise InvalidRequestError(
                f"structured_outputs_backend={self.structured_outputs_backend!r} is unknown; "
                f"use one of {', '.join(BACKEND_CHOICES)}"
            )
        if self.reasoning_parser not in ("auto", "none"):
            from tokenmill.parsers.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # raises naming the known ones
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(
                f"dtype={self.dtype!r} is not supported; use auto or one of {', '.join(DTYPES)}"
            )
        from tokenmill.quant.plan import check_activation_precision, check_quantization

        check_quantization(self.quantization)
        check_activation_precision(self.activation_precision)
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise InvalidRequestError(f"device={self.device!r}: use auto, cpu, cuda or cuda:N")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidRequestError(f"device={self.device!r} asked for but CUDA is not available")
        from tokenmill.attention.backends import resolve_backend_name

        resolve_backend_name(self.attention_backend, self.torch_device())
        from tokenmill.spec_decode.config import resolve_speculative

        tree = {
            name: getattr(self, name)
            for name in ("draft_top_k", "draft_step", "verify_tree_size", "max_verify_tree_size")
        }
        speculative = resolve_speculative(
            self.speculative_config, self.speculative_method, self.draft_model_id_or_path,
            self.num_speculative_tokens, tree,
        )  # fmt: skip
        object.__setattr__(self, "speculative", speculative)  # derived once, here
        from tokenmill.distributed.config import ParallelConfig

        parallel = ParallelConfig(
            self.tensor_parallel_size, self.pipeline_parallel_size,
            self.distributed_executor_backend or "mp", self.data_parallel_size,
            self.ray_address, self.data_parallel_routing,
        )  # fmt: skip
        object.__setattr__(self, "parallel", parallel)

    def _check_state_pool(self) -> None:
        ratio = self.ssm_full_memory_ratio
        if ratio is not None and self.ssm_state_cache_size is not None:
            raise InvalidRequestError(
                f"ssm_state_cache_size={self.ssm_state_cache_size} and ssm_full_memory_ratio="
                f"{ratio} both size the state pool; give one of them"
            )
        if ratio is not None and (
            isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0
        ):
            raise InvalidRequestError(f"ssm_full_memory_ratio must be > 0, got {ratio!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def overlaps_steps(self) -> bool:
        """Whether ``async_scheduling`` is on for this device."""
        if self.async_scheduling == "auto":
            return self.torch_device().type == "cuda"
        return self.async_scheduling == "on"

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
