"""Turns scheduler decisions into tensors, runs the model, samples."""

from tokenmill.worker.model_runner import ModelRunner, ModelRunnerOutput, TokenLogprobs

__all__ = ["ModelRunner", "ModelRunnerOutput", "TokenLogprobs"]
