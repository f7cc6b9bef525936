"""Vision- and audio-language models under tensor and pipeline parallelism (gloo ranks on
the CPU): the driver encodes the media with its whole encoder and broadcasts the
embeddings with the step; the ranks split the language model. The greedy tokens of a batch
that mixes media and text prompts equal the one-process engine's (which the multimodal
tests hold to transformers). The test models' vocabularies outrun their tokenizers, so
tokens are compared, not logprobs (whose entries carry token bytes)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "multimodal"))
sys.path.insert(0, str(Path(__file__).parent.parent / "hybrid"))
import gemma3_checkpoints as gemma3  # noqa: E402
import qwen2_audio_checkpoints as qwen2_audio  # noqa: E402
import qwen3_5_vl_checkpoints as qwen3_5_vl  # noqa: E402
import qwen3_vl_checkpoints as qwen3_vl  # noqa: E402
import smolvlm_checkpoints as smolvlm  # noqa: E402
from qwen_vl_checkpoints import make_qwen_vl, random_image  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.executor.multiproc import MultiprocExecutor  # noqa: E402

STEPS = 16
CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QWEN_IMG = "<|vision_start|><|image_pad|><|vision_end|>"
TP2, PP2, TP2_PP2 = {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {
    "tensor_parallel_size": 2, "pipeline_parallel_size": 2}  # fmt: skip


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], Path]
    user: str
    """The chat turn a prompt's text goes into."""
    marker: str
    """What stands for one media item in a prompt."""
    kind: str
    """multi_modal_data's key."""
    media: Callable[[int], Any]
    """seed -> one media item."""
    encoder: str
    """The driver's local model's encoder attribute."""


def _image(seed: int) -> Any:
    return random_image(56 + 28 * seed, 84 - 14 * seed, seed)


CASES = {
    "qwen2_5_vl": Case(lambda p: make_qwen_vl(p, seed=0), CHATML, QWEN_IMG, "image", _image,
                       "visual"),
    "qwen3_vl": Case(lambda p: qwen3_vl.make_qwen3_vl(p, seed=0), CHATML, QWEN_IMG, "image",
                     lambda s: random_image(64 + 32 * s, 96 - 16 * s, s), "visual"),
    "qwen3_5_vl": Case(lambda p: qwen3_5_vl.make_qwen3_5_vl(p, seed=0), CHATML, QWEN_IMG, "image",
                       lambda s: random_image(64 + 32 * s, 96 - 16 * s, s), "visual"),
    "gemma3": Case(lambda p: gemma3.make_gemma3(p, seed=0),
                   "<bos><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n",
                   "<start_of_image>", "image", _image, "vision"),
    "smolvlm": Case(lambda p: smolvlm.make_smolvlm(p, seed=0),
                    "<|im_start|>User:{}<end_of_utterance>\nAssistant:", "<image>", "image",
                    _image, "vision"),
    "qwen2_audio": Case(lambda p: qwen2_audio.make_qwen2_audio(p, seed=0), CHATML,
                        "<|audio_bos|><|AUDIO|><|audio_eos|>", "audio",
                        lambda s: (qwen2_audio.random_audio(1.0 + s, s), 16000), "audio_tower"),
}  # fmt: skip


def _prompts(case: Case) -> list:
    """One item, text only, two items: the batch mixes media and text rows."""
    one = {"prompt": case.user.format(case.marker + "describe"),
           "multi_modal_data": {case.kind: case.media(0)}}  # fmt: skip
    two = {"prompt": case.user.format(case.marker + "and" + case.marker),
           "multi_modal_data": {case.kind: [case.media(1), case.media(2)]}}  # fmt: skip
    return [one, case.user.format("text only, between the media"), two]


def _run(path: Path, case: Case, **sizes) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True)
    options = {"max_model_len": 2048, "num_kv_blocks": 1024, "block_size": 4,
               "check_kv_integrity": True, **sizes}  # fmt: skip
    with LLM(str(path), dtype="float32", device="cpu", **options) as llm:
        if sizes:
            assert isinstance(llm.engine.executor, MultiprocExecutor)
            assert getattr(llm.engine.loaded.model.local, case.encoder) is not None
        outs = llm.generate(_prompts(case), params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("media_parallel")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = CASES[name].make(root / name)
        return made[name]

    return get


def _check(checkpoints, name: str, sizes: list[dict]) -> None:
    case, path = CASES[name], checkpoints(name)
    ref = _run(path, case)
    for size in sizes:
        assert _run(path, case, **size) == ref, size


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl", "qwen3_5_vl", "gemma3"])
def test_images_under_tp2_and_pp2_equal_one_process(checkpoints, name):
    _check(checkpoints, name, [TP2, PP2])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smolvlm", "qwen2_audio"])
def test_other_media_families_tp2_and_pp2(checkpoints, name):
    _check(checkpoints, name, [TP2, PP2])


@pytest.mark.slow
def test_images_under_tp2_x_pp2_equal_one_process(checkpoints):
    _check(checkpoints, "qwen3_vl", [TP2_PP2])


def test_a_first_stage_without_the_deepstack_layers_is_refused(checkpoints):
    """Qwen3-VL adds its 2 DeepStack features after layers 0 and 1, on the stage that
    embeds: 3 stages of its 3 layers leave that stage one layer, refused before any worker."""
    started = time.monotonic()
    with pytest.raises(ValueError, match="first pipeline stage .* holds 1 layers.*first 2"):
        LLM(str(checkpoints("qwen3_vl")), dtype="float32", device="cpu", pipeline_parallel_size=3)
    assert time.monotonic() - started < 5
