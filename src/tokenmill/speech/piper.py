"""A Piper voice: its ``.onnx`` weights (read as initializers) and ``.onnx.json`` phoneme map."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.speech.detect import piper_voice_file
from tokenmill.speech.vits import Scales, Vits, VitsConfig

BOS, EOS, PAD = "^", "$", "_"


def _onnx_weights(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(module name, array) for every weight; the exporter's anonymous names (the folded
    weight-norm convolutions) are named after the Conv node that reads them."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    arrays = {i.name: i for i in graph.initializer}
    for node in graph.node:
        if node.op_type in ("Conv", "ConvTranspose") and node.input[1].startswith("onnx::"):
            module = node.name.strip("/").rsplit("/", 1)[0].replace("/", ".")
            yield f"{module}.weight", numpy_helper.to_array(arrays[node.input[1]])
    for name, init in arrays.items():
        if name == "sid":  # the exporter's name for the phoneme embedding
            yield "enc_p.emb.weight", numpy_helper.to_array(init)
        elif name == "/dp/flows.0/Exp_output_0":  # exp(-logs), folded
            yield "dp.flows.0.logs", -np.log(numpy_helper.to_array(init))
        elif re.match(r"^[a-z_]+\.", name):
            yield name, numpy_helper.to_array(init)


@dataclass(frozen=True)
class PiperVoice:
    name: str
    model: Vits
    sample_rate: int
    phoneme_ids: dict[str, list[int]]
    espeak_voice: str
    scales: Scales

    def ids(self, phonemes: str) -> list[int]:
        """IPA -> ids as piper-tts makes them: ^ _, each known phoneme followed by _, then $."""
        m = self.phoneme_ids
        out = m[BOS] + m[PAD]
        for ph in phonemes:
            if ph in m:
                out += m[ph] + m[PAD]
        return out + m[EOS]


def load_piper(path: str | Path) -> PiperVoice:
    onnx_path = piper_voice_file(path)
    if onnx_path is None:
        raise ValueError(f"{path} is not a Piper voice (an .onnx with its .onnx.json beside it)")
    meta: dict[str, Any] = json.loads(onnx_path.with_suffix(".onnx.json").read_text())
    if meta.get("num_speakers", 1) > 1:
        raise ValueError(f"{onnx_path.name}: multi-speaker Piper voices are not supported yet")
    weights = {
        name: torch.from_numpy(np.array(a, dtype=np.float32))
        for name, a in _onnx_weights(onnx_path)
    }
    cfg = VitsConfig(n_vocab=weights["enc_p.emb.weight"].shape[0])
    with torch.device("meta"):
        model = Vits(cfg)
    shapes = {k: t.shape for k, t in model.state_dict().items()}
    for k in shapes:
        if k.startswith("dp.flows.1.") and k not in weights:  # unused at inference: not exported
            weights[k] = torch.zeros(shapes[k])
    missing = set(shapes) - set(weights)
    if missing:
        raise ValueError(
            f"{onnx_path.name}: not the Piper 'medium' VITS layout (missing {sorted(missing)[:4]})"
        )
    model.load_state_dict({k: weights[k] for k in model.state_dict()}, strict=True, assign=True)
    model.eval().requires_grad_(False)
    model.dec.to_nhwc()
    inf = meta.get("inference", {})
    scales = Scales(
        inf.get("noise_scale", 0.667), inf.get("length_scale", 1.0), inf.get("noise_w", 0.8)
    )
    name = onnx_path.name.removesuffix(".onnx")
    rate = int(meta["audio"]["sample_rate"])
    voice = meta.get("espeak", {}).get("voice", "en-us")
    return PiperVoice(name, model, rate, meta["phoneme_id_map"], voice, scales)
