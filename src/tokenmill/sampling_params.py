"""Per-request sampling parameters, vLLM-compatible in names, defaults and ranges.

``SamplingParams`` is checked once, in ``__post_init__`` (the API boundary): bad
values raise ``InvalidRequestError`` with a message naming the field, the allowed
range and the value received. Checks that need the model (``verify_for_vocab``)
or the engine config (``max_logprobs``, context length) are done by the engine.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output.params import StructuredOutputsParams

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy decoding (argmax), as in vLLM."""
MAX_LOGPROBS = 20
"""Upper bound for ``logprobs`` / ``prompt_logprobs`` (OpenAI's limit)."""
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_RANGE = 100.0
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts

# HF generation_config.json keys that become default sampling parameters (vLLM's set,
# minus max_new_tokens: only the sampling knobs are taken from the checkpoint).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class RequestOutputKind(enum.Enum):
    """What each streamed ``RequestOutput`` carries."""

    CUMULATIVE = 0  # all tokens/text generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request and when to stop."""

    n: int = 1
    """Number of output sequences to return for the prompt."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output. [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence of a token in the output. [-2, 2]."""
    repetition_penalty: float = 1.0
    """HF-style: logits of prompt/output tokens are divided (>0) or multiplied (<=0) by it."""
    temperature: float = 1.0
    """Softmax temperature; below 1e-5 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables it (normalized to 0)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's probability."""
    seed: int | None = None
    """Seed of the request's own random generator; None draws from the engine's. -1 = None."""
    stop: str | list[str] | None = None
    """Strings that end generation when produced (normalized to a list)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (normalized to a list)."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the output text."""
    ignore_eos: bool = False
    """Keep generating past the EOS token (EOS no longer stops the request)."""
    max_tokens: int | None = 16
    """Maximum number of tokens to generate; None = up to the context limit."""
    min_tokens: int = 0
    """EOS and stop_token_ids are suppressed until this many tokens were generated."""
    logprobs: int | None = None
    """Return this many top alternatives per output token (0 = only the sampled one's)."""
    prompt_logprobs: int | None = None
    """As ``logprobs``, for each prompt token."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    spaces_between_special_tokens: bool = True
    """Put spaces between special tokens when detokenizing."""
    logit_bias: Mapping[int, float] | None = None
    """token id -> bias added to its logit, in [-100, 100]; str keys (JSON) are converted."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each streamed output carries; see ``RequestOutputKind``."""
    detokenize: bool = True
    """Produce text; False leaves every output's ``text`` empty (token ids only, no
    detokenization cost) and allows no stop strings."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output (JSON schema, regex, choice, grammar...); an empty guide = None."""
    # -- vLLM's other names ---------------------------------------------------------
    guided_decoding: StructuredOutputsParams | None = None
    """vLLM's older name of ``structured_outputs`` (both end up holding the same guide)."""
    best_of: int | None = None
    """vLLM: sample best_of sequences, return the n best. Only None or n is accepted:
    tokenmill returns every sequence it samples (ask for n)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens (applied by ``LLM`` and the server when the prompt
    is tokenized; see ``truncate_prompt``)."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be generated (every other logit is set to -inf)."""
    bad_words: list[str] | None = None
    """vLLM: words that may not be generated. Each word is tokenized as written and with
    a leading space (``resolve_bad_words``, when the request is added); a word's last
    token is banned whenever the tokens generated just before it are the rest of the
    word. A word of several tokens reads the tokens so far, so it makes the request's
    steps synchronous (``reads_output_tokens``)."""
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    """The token ids of each ``bad_words`` variant; set by ``resolve_bad_words``."""
    logits_processors: list[Callable[..., Any]] | None = None
    """Per-request callables ``f(output_token_ids, logits) -> logits`` or
    ``f(prompt_token_ids, output_token_ids, logits) -> logits``, vLLM's (v0) contract:
    ``logits`` is this row's float32 [V] tensor; they run after the built-in processors,
    in order, and make the request's steps synchronous (they read the tokens so far)."""
    disable_spec_decode: bool = False
    """Never verify draft tokens for this request (when the engine speculates)."""

    def __post_init__(self) -> None:
        self._normalize()
        self._verify_vllm_names()
        self._verify_sampling()
        self._verify_lengths()
        self._verify_logprobs()
        self._verify_stops()
        if self.is_greedy:  # filters are meaningless for argmax; keep the sampler's fast path
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    # ---- validation -------------------------------------------------------------

    def _normalize(self) -> None:
        self.n = _int("n", self.n)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            setattr(self, name, _finite(name, getattr(self, name)))
        self.top_k = _int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            _check(
                _SEED_MIN <= self.seed <= _SEED_MAX,
                f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}",
            )
            if self.seed == -1:
                self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            self.stop is None or isinstance(self.stop, (list, tuple)),
            f"stop must be a string or a list of strings, got {self.stop!r}",
        )
        self.stop = list(self.stop or [])
        self.stop_token_ids = [_int("stop_token_ids entry", t) for t in self.stop_token_ids or []]
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.guided_decoding is not None:
            _check(
                self.structured_outputs in (None, self.guided_decoding),
                "set structured_outputs or its older name guided_decoding, not both",
            )
            self.structured_outputs = self.guided_decoding
        self.structured_outputs = _normalize_guide(self.structured_outputs)
        self.guided_decoding = self.structured_outputs

    def _verify_vllm_names(self) -> None:
        if self.best_of is not None:
            self.best_of = _int("best_of", self.best_of)
            _check(
                self.best_of == self.n,
                f"best_of={self.best_of} with n={self.n} is not supported: tokenmill "
                "returns every sequence it samples; ask for n sequences instead",
            )
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _int(
                "truncate_prompt_tokens", self.truncate_prompt_tokens
            )
            _check(
                self.truncate_prompt_tokens >= 1,
                f"truncate_prompt_tokens must be >= 1 or None, got {self.truncate_prompt_tokens}",
            )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [
                _int("allowed_token_ids entry", t) for t in self.allowed_token_ids
            ]
            _check(bool(self.allowed_token_ids), "allowed_token_ids must not be empty")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            for word in self.bad_words:
                _check(
                    isinstance(word, str) and word.strip() != "",
                    f"bad_words must contain only non-empty strings, got {word!r}",
                )
        if self.logits_processors is not None:
            self.logits_processors = list(self.logits_processors)
            for f in self.logits_processors:
                _check(callable(f), f"logits_processors entries must be callables, got {f!r}")

    def _verify_sampling(self) -> None:
        _check(self.n >= 1, f"n must be >= 1, got {self.n}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= -1 (0 or -1 disables it), got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value}")
        _check(
            self.repetition_penalty > 0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )

    def _verify_lengths(self) -> None:
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens)
            _check(self.max_tokens >= 1, f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
            )

    def _verify_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            value = _int(name, value)
            _check(
                0 <= value <= MAX_LOGPROBS,
                f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value}",
            )
            setattr(self, name, value)

    def _verify_stops(self) -> None:
        for s in self.stop:
            _check(
                isinstance(s, str) and s != "",
                f"stop must contain only non-empty strings, got {s!r}",
            )
        for t in self.stop_token_ids:
            _check(t >= 0, f"stop_token_ids must be >= 0, got {t}")
        _check(
            self.detokenize or not self.stop,
            "stop strings need detokenize=True (use stop_token_ids to stop on token ids)",
        )
        _check(
            isinstance(self.output_kind, RequestOutputKind),
            f"output_kind must be a RequestOutputKind, got {self.output_kind!r}",
        )

    def verify_for_vocab(self, vocab_size: int) -> None:
        """Raise if a token id given in the request is outside [0, vocab_size)."""
        for name, ids in (
            ("logit_bias", self.logit_bias or {}),
            ("stop_token_ids", self.stop_token_ids or []),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            for t in ids:
                _check(
                    0 <= t < vocab_size,
                    f"{name} token id {t} is out of range: must be in [0, {vocab_size})",
                )

    # ---- derived ----------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def reads_output_tokens(self) -> bool:
        """Picking a token reads the tokens generated so far on the host (a grammar, which
        advances there; a per-request logits processor, a Python callable): the step
        cannot be scheduled before the previous token is on the host. ``min_tokens``
        reads only a count, which includes the tokens in flight, and penalties count the
        token in flight on the device (``sampler.InFlightRow``): neither needs this."""
        return (
            self.structured_outputs is not None
            or bool(self.logits_processors)
            or self._bad_words_read_history
        )

    @property
    def _bad_words_read_history(self) -> bool:
        """A bad word of several tokens compares the tokens before its last one."""
        if not self.bad_words:
            return False
        if self.bad_words_token_ids is None:  # not resolved yet: assume the worst
            return True
        return any(len(ids) > 1 for ids in self.bad_words_token_ids)

    def resolve_bad_words(self, tokenizer: Any, vocab_size: int) -> None:
        """Tokenize ``bad_words`` as vLLM does: each word stripped of leading spaces, as
        written and with a leading space; the spaced variant is kept only when it is a
        different token sequence of the same length. Idempotent."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return
        variants: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            variants.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                variants.append(spaced)
        for ids in variants:
            for t in ids:
                _check(
                    0 <= t < vocab_size,
                    f"bad_words token id {t} is out of range: must be in [0, {vocab_size})",
                )
        self.bad_words_token_ids = variants

    def truncate_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt as ``truncate_prompt_tokens`` asks: its last k tokens (or all)."""
        k = self.truncate_prompt_tokens
        ids = list(prompt_token_ids)
        return ids[-k:] if k is not None and len(ids) > k else ids

    def clone(self) -> SamplingParams:
        """A deep copy (parameters are mutable; each request should own its copy)."""
        return copy.deepcopy(self)

    @classmethod
    def from_generation_config(cls, gen_cfg: Mapping[str, Any], **overrides: Any) -> SamplingParams:
        """Defaults from a HF ``generation_config.json`` dict, then ``overrides`` on top.

        Only the sampling knobs in ``GENERATION_CONFIG_KEYS`` are read (``do_sample``
        and ``max_new_tokens`` are ignored); null values are skipped.
        """
        kwargs = {k: gen_cfg[k] for k in GENERATION_CONFIG_KEYS if gen_cfg.get(k) is not None}
        kwargs.update(overrides)
        return cls(**kwargs)


def generation_defaults(source: str, checkpoint: Mapping[str, Any] | None) -> SamplingParams:
    """Default sampling parameters (vLLM's ``generation_config`` option): "auto" = the
    checkpoint's generation_config.json, "vllm" = the library defaults, a folder = the
    generation_config.json in it."""
    if source == "vllm":
        return SamplingParams()
    if source != "auto":
        import json
        from pathlib import Path

        path = Path(source) / "generation_config.json"
        _check(
            path.is_file(),
            f"generation_config={source!r}: no {path} (use auto, vllm "
            "or a folder holding generation_config.json)",
        )
        checkpoint = json.loads(path.read_text())
    return SamplingParams.from_generation_config(checkpoint) if checkpoint else SamplingParams()


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


def _int(name: str, value: Any) -> int:
    _check(
        isinstance(value, numbers.Integral) and not isinstance(value, bool),
        f"{name} must be an int, got {value!r}",
    )
    return int(value)


def _finite(name: str, value: Any) -> float:
    _check(
        isinstance(value, numbers.Real) and not isinstance(value, bool),
        f"{name} must be a number, got {value!r}",
    )
    _check(math.isfinite(value), f"{name} must be a finite number, got {value}")
    return float(value)


def _normalize_logit_bias(bias: Mapping[Any, Any] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    _check(isinstance(bias, Mapping), f"logit_bias must be a dict, got {type(bias).__name__}")
    _check(
        len(bias) <= MAX_LOGIT_BIAS_ENTRIES,
        f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
    )
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_key(key)
        value = _finite(f"logit_bias[{token}]", value)
        _check(
            -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE,
            f"logit_bias[{token}] must be in [-100, 100], got {value}",
        )
        out[token] = value
    return out


def _normalize_guide(guide: Any) -> StructuredOutputsParams | None:
    if guide is None:
        return None
    if isinstance(guide, Mapping):
        guide = StructuredOutputsParams.from_dict(dict(guide))
    _check(
        isinstance(guide, StructuredOutputsParams),
        f"structured_outputs must be a StructuredOutputsParams, got {type(guide).__name__}",
    )
    if guide.is_empty:
        return None
    guide.spec()  # raises on a malformed JSON schema or structural tag
    return guide


def _token_key(key: Any) -> int:
    """JSON object keys are strings: accept "123" as well as 123."""
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (integers), got {key!r}"
            ) from None
    return _int("logit_bias key", key)
