"""Chat requests with media on the OpenAI server: image parts -> images at the boundary.

``serving_chat`` calls ``chat_media_of`` before rendering (image parts become
``{"type": "image"}`` for the template, their images are loaded under the engine's media
policy) and ``ChatMedia.attach`` after (placeholder runs, the request's media inputs).
Every bad input is an ``InvalidRequestError``: the server answers 400 with an OpenAI
error object and keeps serving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.request import RequestOptions
from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.chat import extract_media, has_media
from tokenmill.multimodal.inputs import MultiModalInputs
from tokenmill.multimodal.options import parse_processor_kwargs
from tokenmill.multimodal.prompt import MediaProcessor, media_policy, no_encoder_error


@dataclass(frozen=True)
class ChatMedia:
    messages: list[dict[str, Any]]
    media: dict[str, list[Any]]
    processor: MediaProcessor | None
    kwargs: Mapping[str, Any] | None

    def attach(self, prompt_ids: list[int]) -> tuple[list[int], MultiModalInputs | None]:
        """Rendered ids -> (ids with placeholder runs, media inputs); unchanged without media."""
        if self.processor is None or not self.media:
            return prompt_ids, None
        opts = parse_processor_kwargs(self.kwargs)
        return self.processor.process(prompt_ids, self.media, opts)


def chat_media_of(
    engine: Any, messages: list[dict[str, Any]], kwargs: Mapping[str, Any] | None
) -> ChatMedia:
    """Load the images of a chat request (the engine's processor and media policy)."""
    processor = getattr(engine, "mm_processor", None)
    if not hasattr(engine, "mm_processor") and (has_media(messages) or kwargs):
        raise InvalidRequestError(  # an engine process whose processor did not pickle
            "media input is off on this server: its engine runs in another process and the "
            "model's media processor could not be sent there (see the server log); serve it "
            "with --engine-process off and data_parallel_size=1 for images, video and audio"
        )
    if not has_media(messages):
        if kwargs and processor is None:
            raise no_encoder_error(engine.config)
        return ChatMedia(messages, {}, processor, kwargs)
    if processor is None:
        raise no_encoder_error(engine.config)
    parse_processor_kwargs(kwargs)  # bad options fail before any media is fetched
    stripped, media = extract_media(messages, media_policy(engine.config))
    return ChatMedia(stripped, media, processor, kwargs)


def is_media_message(message: Any) -> bool:
    """A message whose content list holds image parts (the template reads the list)."""
    content = message.get("content") if isinstance(message, Mapping) else None
    return isinstance(content, list) and any(
        isinstance(p, Mapping) and p.get("type") in ("image", "video", "audio") for p in content
    )


def with_media(options: RequestOptions, mm: MultiModalInputs | None) -> RequestOptions:
    return options if mm is None else dataclasses.replace(options, multimodal=mm)
