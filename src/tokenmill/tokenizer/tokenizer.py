"""``Tokenizer``: the one object the engine uses for text <-> token ids."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from tokenmill.errors import InvalidRequestError, ModelLoadError
from tokenmill.loader.checkpoint import Checkpoint
from tokenmill.tokenizer.chat import validate_conversation
from tokenmill.tokenizer.hf_folder import load_hf_folder
from tokenmill.tokenizer.token_bytes import spelling_of


class Tokenizer:
    """A thin wrapper around a transformers fast tokenizer.

    Invariants: ``encode`` adds BOS exactly when the checkpoint's tokenizer does (its
    ``add_bos_token`` / post-processor); ``decode`` never "cleans up" spaces, so text
    is exactly what the model produced and incremental decoding can match it.
    """

    hf: PreTrainedTokenizerBase
    vocab_size: int
    """len(tokenizer): valid ids are 0 .. vocab_size - 1 (may differ from the model's rows)."""
    eos_token_ids: frozenset[int]
    """Ids that end generation: tokenizer eos + generation_config eos + config eos."""
    bos_token_id: int | None
    chat_template: str | None

    def __init__(
        self, hf: PreTrainedTokenizerBase, extra_eos_token_ids: Iterable[int] = ()
    ) -> None:
        self.hf = hf
        self.vocab_size = len(hf)
        self.bos_token_id = hf.bos_token_id
        own_eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_token_ids = frozenset([*own_eos, *extra_eos_token_ids])
        self.chat_template = _default_template(hf.chat_template)
        self._adds_bos = self._detect_adds_bos()
        backend = getattr(hf, "backend_tokenizer", None)
        self._spelling = spelling_of(backend.decoder) if backend is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        return cast(str, text)

    def apply_chat_template(
        self,
        conversation: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render ``conversation`` with the template and tokenize it.

        Special tokens the template writes (``<|im_start|>``, ``<bos>``) become their ids;
        BOS is prepended only when this tokenizer adds one and the template did not.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise InvalidRequestError(
                "this model has no chat template (a base model?); send a plain completion "
                "prompt, or pass chat_template='...jinja...'"
            )
        validate_conversation(conversation)
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message=True continues the last message, so it needs "
                "add_generation_prompt=False"
            )
        text = self._render(
            conversation,
            template,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
        ids = self.encode(text, add_special_tokens=False)
        bos = self.bos_token_id
        if self._adds_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (a partial UTF-8 character stays partial)."""
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequestError(
                f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        token = cast("str | None", self.hf.convert_ids_to_tokens(token_id))
        if self._spelling is None or token is None:
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return self._spelling(token)

    def _render(
        self, conversation: list[dict], template: str, tools: list | None, **kwargs: Any
    ) -> str:
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(
                conversation, chat_template=template, tools=tools, tokenize=False, **kwargs
            )
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError(
                f"the chat template can not render these messages: {e}"
            ) from e
        return cast(str, text)

    def _detect_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        plain = self.hf.encode("a", add_special_tokens=False)
        special = self.hf.encode("a", add_special_tokens=True)
        return special[:1] == [self.bos_token_id] and plain[:1] != [self.bos_token_id]


def _default_template(template: str | dict | None) -> str | None:
    if isinstance(template, dict):  # several named templates: "default" is the chat one
        return template.get("default")
    return template


def load_tokenizer(checkpoint: Checkpoint, tokenizer: str | None = None) -> Tokenizer:
    """The tokenizer of ``checkpoint``, or of the HF folder / .gguf file ``tokenizer`` when
    given; eos ids of the checkpoint's config and generation_config are added."""
    source = Path(tokenizer).expanduser() if tokenizer else Path(checkpoint.path)
    if not source.exists():
        raise ModelLoadError(
            f"tokenizer path {str(source)!r} does not exist; pass a HF tokenizer folder"
        )
    hf = _load_hf_tokenizer(source)
    extra = [*_ids(checkpoint.generation_config.get("eos_token_id")),
             *_ids(checkpoint.hf_config.get("eos_token_id"))]  # fmt: skip
    return Tokenizer(hf, extra)


def _load_hf_tokenizer(source: Path) -> PreTrainedTokenizerBase:
    if source.is_file():
        from tokenmill.tokenizer.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(source)
    try:
        return load_hf_folder(source)
    except Exception as e:  # noqa: BLE001 - the Rust parser of tokenizer.json raises a bare Exception
        raise ModelLoadError(
            f"no usable tokenizer in {source} ({e}); it needs tokenizer.json (or "
            "tokenizer_config.json with its vocabulary files), or pass tokenizer=PATH"
        ) from e


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]
