"""Executors: how the engine's steps reach the model (in process, or on workers)."""

from tokenmill.executor.base import Executor
from tokenmill.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
