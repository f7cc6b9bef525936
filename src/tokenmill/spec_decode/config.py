"""``speculative_config``: vLLM's dict (or the flat names) -> one checked, frozen config.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    LLM(model, speculative_method="ngram", num_speculative_tokens=5)   # the flat form

Every bad value or combination raises ``InvalidRequestError`` (a ``ValueError``) naming
the field, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from tokenmill.errors import InvalidRequestError

METHODS = ("ngram", "suffix", "draft_model", "eagle3", "mtp")
"""vLLM's method names; ``[ngram]`` / ``prompt_lookup`` are accepted as ngram."""
_ALIASES = {"[ngram]": "ngram", "prompt_lookup": "ngram", "draft": "draft_model"}
MAX_SPECULATIVE_TOKENS = 16
TREE_FIELDS = ("draft_top_k", "draft_step", "verify_tree_size", "max_verify_tree_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """ngram (prompt lookup), suffix (suffix decoding), draft_model (a smaller model),
    eagle3 (an EAGLE-3 head folder in ``model``), mtp (the target checkpoint's own
    multi-token-prediction layers)."""
    num_speculative_tokens: int = 5
    """Most draft tokens verified per request per step; the engine chooses fewer (or
    none) per step where more would not pay (``spec_decode/adaptive.py``)."""
    model: str | None = None
    """draft_model: the draft checkpoint (HF folder or GGUF); its vocabulary must map every
    token to the same id as the target's. eagle3: the head's folder (config.json and its
    weights). mtp: another copy of the target checkpoint (default: the target's own)."""
    prompt_lookup_min: int = 2
    """ngram: shortest suffix of the request's tokens to look up."""
    prompt_lookup_max: int = 5
    """ngram: longest suffix looked up (the longest match wins)."""
    draft_tensor_parallel_size: int = 1
    """Only 1 (the draft runs on the target's device)."""
    quantization: str | None = None
    """draft_model: the draft's weight format (the engine's ``quantization`` names: auto,
    none, gguf, int8, int4; None: the target's setting). A draft's precision changes only
    how often its guesses are accepted, never the output: int4 halves the bytes a draft
    step reads from an 8-bit draft (a CPU draft step is bound by them)."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: longest context (tokens) the shared suffix index keys on."""
    suffix_decoding_max_cached_requests: int = 1000
    """suffix: finished requests whose tokens stay in the shared index (oldest dropped)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: a draft is at most this many times the matched context's length."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: drafting stops when the estimated chance of the whole draft falls below."""
    adaptive: bool = True
    """Choose each step's draft length from acceptance and the measured verify cost
    (False: always up to num_speculative_tokens; for tests and benchmarks)."""
    draft_top_k: int = 1
    """Draft trees: guesses per position (1: one chain), all verified in one step. eagle3
    and mtp: each depth of the head's chain gets its next k - 1 guesses as leaves beside
    it; suffix: each node's k most frequent successors, best paths first; ngram: what
    followed the longest suffix's latest occurrences, branching where they differ."""
    verify_tree_size: int | None = None
    """Draft trees: most nodes verified per request per step, the most likely ones by the
    head's path probability (default: every node, depth x draft_top_k)."""
    max_verify_tree_size: int | None = None
    """Draft trees: an upper bound that verify_tree_size may not pass (the seeds' name)."""

    @property
    def is_tree(self) -> bool:
        """Whether steps verify draft trees (else one chain per request)."""
        return (
            self.draft_top_k > 1
            or self.verify_tree_size is not None
            or (self.max_verify_tree_size is not None)
        )

    @property
    def tree_nodes(self) -> int:
        """A tree's node budget (``verify_tree_size``)."""
        return (
            self.verify_tree_size or self.max_verify_tree_size
            or self.num_speculative_tokens * self.draft_top_k
        )  # fmt: skip

    def __post_init__(self) -> None:
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError(
                f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.draft_tensor_parallel_size != 1:
            raise InvalidRequestError(
                "speculative_config: draft_tensor_parallel_size must be 1 (the draft runs on "
                f"the target's device), got {self.draft_tensor_parallel_size!r}"
            )
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1, 256)
        _check_int(
            "suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests,
            0, 1_000_000,
        )  # fmt: skip
        if not 0 < float(self.suffix_decoding_max_spec_factor) <= 64:
            raise InvalidRequestError(
                "speculative_config: suffix_decoding_max_spec_factor must be in (0, 64], "
                f"got {self.suffix_decoding_max_spec_factor!r}"
            )
        if not 0 <= float(self.suffix_decoding_min_token_prob) <= 1:
            raise InvalidRequestError(
                "speculative_config: suffix_decoding_min_token_prob must be in [0, 1], "
                f"got {self.suffix_decoding_min_token_prob!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise InvalidRequestError(
                "speculative_config: method 'draft_model' needs 'model' (the draft checkpoint)"
            )
        if self.quantization is not None:
            if self.method != "draft_model":
                raise InvalidRequestError(
                    "speculative_config: quantization is the draft model's weight format; "
                    f"method {self.method!r} loads no draft model"
                )
            from tokenmill.quant.plan import check_quantization

            try:
                check_quantization(self.quantization)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"speculative_config: {e}") from None
        _check_int("draft_top_k", self.draft_top_k, 1, 16)
        for name in ("verify_tree_size", "max_verify_tree_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1, 256)
        if self.tree_nodes > (self.max_verify_tree_size or self.tree_nodes):
            raise InvalidRequestError(
                f"speculative_config: verify_tree_size={self.tree_nodes} exceeds "
                f"max_verify_tree_size={self.max_verify_tree_size}"
            )
        if self.is_tree and self.method not in TREE_METHODS:
            raise InvalidRequestError(
                f"speculative_config: draft trees (draft_top_k, verify_tree_size) need a "
                f"method whose head ranks its guesses ({', '.join(TREE_METHODS)}); "
                f"{self.method!r} drafts one chain"
            )
        if self.method == "eagle3" and not self.model:
            raise InvalidRequestError(
                "speculative_config: method 'eagle3' needs 'model' (the EAGLE-3 head's folder)"
            )
        if self.method in ("ngram", "suffix") and self.model:
            raise InvalidRequestError(
                f"speculative_config: method {self.method!r} takes no 'model' "
                "(drafts come from the request's own tokens); drop it or use draft_model"
            )


TREE_METHODS = ("eagle3", "mtp", "suffix", "ngram")
"""Methods that draft trees (their heads or counts rank every guess)."""


def resolve_speculative(
    speculative_config: Mapping[str, Any] | SpeculativeConfig | None,
    speculative_method: str | None = None,
    draft_model_id_or_path: str | None = None,
    num_speculative_tokens: int | None = None,
    tree: Mapping[str, Any] | None = None,
) -> SpeculativeConfig | None:
    """The engine's speculative config from vLLM's dict or the flat names (not both)."""
    flat = {
        k: v
        for k, v in (
            ("method", speculative_method),
            ("model", draft_model_id_or_path),
            ("num_speculative_tokens", num_speculative_tokens),
        )
        if v is not None
    }
    tree_set = {k: v for k, v in (tree or {}).items() if v is not None}
    if speculative_config is not None and flat:
        names = ", ".join(
            {"method": "speculative_method", "model": "draft_model_id_or_path"}.get(k, k)
            for k in flat
        )
        raise InvalidRequestError(f"set speculative_config or the flat options ({names}), not both")
    if isinstance(speculative_config, SpeculativeConfig):
        return speculative_config
    if speculative_config is not None and not isinstance(speculative_config, Mapping):
        raise InvalidRequestError(
            f"speculative_config must be a dict, got {type(speculative_config).__name__}"
        )
    raw: dict[str, Any] = dict(speculative_config or flat)
    for key in TREE_FIELDS:
        if key in raw and raw[key] is not None:
            tree_set[key] = raw.pop(key)
    if not raw:
        if tree_set:
            raise InvalidRequestError(
                f"{', '.join(sorted(tree_set))} shape draft trees: set a speculative method "
                f"too ({', '.join(TREE_METHODS)})"
            )
        return None
    if "draft_step" in tree_set:  # the seeds' name for the tree's depth
        step = tree_set.pop("draft_step")
        if raw.get("num_speculative_tokens", step) != step:
            raise InvalidRequestError(
                f"speculative_config: draft_step={step!r} (the tree's depth) and "
                f"num_speculative_tokens={raw['num_speculative_tokens']!r} disagree; set one"
            )
        raw["num_speculative_tokens"] = step
    return _from_dict({**raw, **tree_set})


CHAIN_METHODS_FOR_RECURRENT = ("ngram", "suffix", "draft_model")
"""Methods that verify draft chains on hybrid and state-space models (their recurrent
layers keep a state per draft position, ``worker/state_rollback.py``)."""


def check_target_cache(spec: SpeculativeConfig | None, cache_specs: Sequence[object]) -> None:
    """Refuse what a model with a recurrent state (hybrid and state-space models) can not
    verify: draft trees (each node would need its own state along its path) and the head
    methods (their KV lives in an attention-only target's blocks). Chains roll back by
    the state kept at each draft position."""
    from tokenmill.kv_cache.spec import RecurrentState

    if spec is None or not any(isinstance(s, RecurrentState) for s in cache_specs):
        return
    if spec.method not in CHAIN_METHODS_FOR_RECURRENT:
        raise InvalidRequestError(
            f"speculative decoding ({spec.method}) is not supported for hybrid or state-space "
            f"models; use method {', '.join(CHAIN_METHODS_FOR_RECURRENT)}"
        )
    if spec.is_tree:
        raise InvalidRequestError(
            "speculative_config: draft trees (draft_top_k, verify_tree_size, "
            "max_verify_tree_size) are not supported for hybrid or state-space models: a "
            "recurrent state rolls back along one chain of drafts; drop them"
        )


def _from_dict(raw: dict[str, Any]) -> SpeculativeConfig:
    raw = dict(raw)
    method = raw.pop("method", None)
    if method is None:  # vLLM infers draft_model from a model path
        if not raw.get("model"):
            raise InvalidRequestError(
                f"speculative_config needs 'method' (one of {', '.join(METHODS)})"
            )
        method = "draft_model"
    method = _ALIASES.get(str(method), str(method))
    if method not in METHODS:
        raise InvalidRequestError(
            f"speculative_config: method {method!r} is unknown; use one of {', '.join(METHODS)}"
        )
    known = {f.name for f in fields(SpeculativeConfig)} - {"method"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidRequestError(
            f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}"
        )
    return SpeculativeConfig(method=method, **raw)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequestError(
            f"speculative_config: {name} must be an integer in [{low}, {high}], got {value!r}"
        )
