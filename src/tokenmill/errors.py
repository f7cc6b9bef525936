"""Exceptions users can catch. All input errors are ValueError subclasses."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base of tokenmill's own errors."""


class InvalidRequestError(TokenmillError, ValueError):
    """A request (prompt or sampling parameters) that can not be served as given."""


class ContextLengthError(InvalidRequestError):
    """Prompt (plus max_tokens) does not fit into max_model_len."""


class UnsupportedModelError(TokenmillError, ValueError):
    """The checkpoint's architecture or tensor format is not supported."""


class ModelLoadError(TokenmillError, ValueError):
    """Missing, unreadable or inconsistent checkpoint files."""


class EngineDeadError(TokenmillError, RuntimeError):
    """The engine was closed or failed and can not take requests."""


class QueueFullError(TokenmillError, RuntimeError):
    """The waiting queue is at max_queued_requests; retry later (HTTP 429)."""


class QueueTimeoutError(TokenmillError, RuntimeError):
    """The request waited longer than queue_timeout to start (HTTP 503)."""


class DrainingError(TokenmillError, RuntimeError):
    """The server is shutting down and accepts no new requests (HTTP 503)."""
