"""Model families, looked up by the checkpoint's `architectures` name."""

from tokenmill.models.registry import SUPPORTED_ARCHITECTURES, resolve_model_class

__all__ = ["SUPPORTED_ARCHITECTURES", "resolve_model_class"]
