"""vLLM's older ``task=`` option means ``runner`` / ``convert``: ``LLM(m, task="embed")``
embeds; a task contradicting an explicit runner, or one not built, is a clear error."""

from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.vllm_compat import check_compat_options


def test_task_maps_to_runner_and_convert():
    for task, want in (
        ("embed", {"runner": "pooling", "convert": "embed"}),
        ("embedding", {"runner": "pooling", "convert": "embed"}),
        ("classify", {"runner": "pooling", "convert": "classify"}),
        ("score", {"runner": "pooling"}),
        ("generate", {"runner": "generate"}),
        ("auto", {}),
    ):
        options = {"task": task}
        check_compat_options(options)
        assert options == want, task
    with pytest.raises(ValueError, match="runner='generate' was set"):
        check_compat_options({"task": "embed", "runner": "generate"})
    with pytest.raises(ValueError, match="task='reward' is not supported"):
        check_compat_options({"task": "reward"})


def test_llm_task_embed_on_minilm(minilm_dir):
    with LLM(str(minilm_dir), task="embed") as llm:
        (out,) = llm.embed(["A man is eating food."])
        assert len(out.outputs.embedding) == 384
