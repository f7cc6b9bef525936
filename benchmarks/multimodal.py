"""Images into a small Qwen2.5-VL-shaped model: tokenmill vs transformers, side by side.

    python benchmarks/multimodal.py                  # 1024 x 1024 image, 3 rounds
    python benchmarks/multimodal.py --size 512 --rounds 5 --load 8
    python benchmarks/multimodal.py --family qwen3_5 --size 448 --skip-load

``--family qwen3_5``: a Qwen3.5-shaped one instead (Qwen3-VL's tower without DeepStack,
``--vision-depth`` blocks of 320 with 16-pixel patches, in front of a 4-layer hybrid of
512: three Gated DeltaNet layers, then gated attention; Qwen3-VL's preprocessor config).

The model has Qwen2.5-VL's structure (window attention in the tower with full attention
every fourth block, patch merger, M-RoPE) at small widths (``--vision-depth`` blocks of
320, a 4-layer language model of 512) and random weights, float32 on CPU, saved once
under ``--cache`` with an offline byte-level tokenizer and Qwen2.5-VL's real
preprocessor config. Reported:

1. Time to first token for one image (a fresh picture every round, so neither engine's
   caches help), split into preprocessing (decode, resize, normalize, patchify: both use
   transformers' PIL image processor), encoding (the vision tower) and prefill (the rest),
   for both engines (medians, the engines taking turns round by round).
2. Text-only requests' time to first token, ``--load`` of them alone, then again with
   ``--load`` image requests submitted at the same moment (images preprocessed first, as
   a server's preprocessing pool would while the engine runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "multimodal"))
from common import table  # noqa: E402
from qwen_vl_checkpoints import (  # noqa: E402
    IM_END,
    IMAGE_PAD,
    PREPROCESSOR,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VOCAB,
    hf_processor,
    make_tokenizer,
    random_image,
    randomize,
)

PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n<|im_start|>assistant\n"  # fmt: skip
TEXT = "<|im_start|>user\nTell me something about the weather in {} today.<|im_end|>\n<|im_start|>assistant\n"  # fmt: skip


def make_checkpoint(cache: Path, depth: int, family: str = "qwen2_5_vl") -> Path:
    return CHECKPOINTS[family](cache, depth)


def make_qwen2_5_vl(cache: Path, depth: int) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    target = cache / f"qwen2.5-vl-small-{depth}"
    if (target / "model.safetensors").is_file():
        return target
    text = dict(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
        eos_token_id=IM_END, pad_token_id=256,
    )  # fmt: skip
    vision = dict(depth=depth, hidden_size=320, num_heads=5, intermediate_size=640, out_hidden_size=512,
                  fullatt_block_indexes=list(range(3, depth, 4)), window_size=112)  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    randomize(model, 0, std=0.05)
    model.save_pretrained(target)
    make_tokenizer().save_pretrained(target)
    (target / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return target


def make_qwen3_5(cache: Path, depth: int) -> Path:
    from qwen3_vl_checkpoints import PREPROCESSOR as QWEN3_PREPROCESSOR
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    target = cache / f"qwen3.5-vl-small-{depth}"
    if (target / "model.safetensors").is_file():
        return target
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 3, 3], "mrope_interleaved": True}  # fmt: skip
    text = dict(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        max_position_embeddings=4096, rope_parameters=rope, eos_token_id=IM_END,
    )  # fmt: skip
    vision = dict(depth=depth, hidden_size=320, num_heads=5, intermediate_size=640,
                  out_hidden_size=512, num_position_embeddings=2304, patch_size=16)  # fmt: skip
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomize(model, 0, std=0.05)
    model.save_pretrained(target)
    make_tokenizer().save_pretrained(target)
    (target / "preprocessor_config.json").write_text(json.dumps(QWEN3_PREPROCESSOR))
    return target


def qwen3_processor(path: Path):
    from qwen3_vl_checkpoints import hf_processor as qwen3_vl_processor

    return qwen3_vl_processor(path)


CHECKPOINTS = {"qwen2_5_vl": make_qwen2_5_vl, "qwen3_5": make_qwen3_5}
"""--family -> (cache, vision depth) -> the checkpoint folder."""
PROCESSORS = {"qwen2_5_vl": hf_processor, "qwen3_5": qwen3_processor}
"""--family -> transformers' processor for the folder."""


class TokenmillTTFT:
    def __init__(self, path: Path) -> None:
        from tokenmill import LLM, SamplingParams

        self.llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=4096,
                       enable_prefix_caching=False)  # fmt: skip
        self.params = SamplingParams(temperature=0, max_tokens=1)

    def __call__(self, image) -> dict[str, float]:
        before = self.llm.get_multimodal_metrics()
        t0 = time.perf_counter()
        self.llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, self.params,
                          use_tqdm=False)  # fmt: skip
        total = time.perf_counter() - t0
        after = self.llm.get_multimodal_metrics()
        pre = after["mm_preprocess_seconds"] - before["mm_preprocess_seconds"]
        enc = after["mm_encoder_seconds"] - before["mm_encoder_seconds"]
        return {"preprocess": pre, "encode": enc, "prefill": total - pre - enc, "ttft": total}


class TransformersTTFT:
    def __init__(self, path: Path, family: str) -> None:
        from transformers import AutoModelForImageTextToText

        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.proc = PROCESSORS[family](path)
        self.encode = 0.0
        visual = self.model.model.visual
        visual.register_forward_pre_hook(lambda *a: setattr(self, "_t", time.perf_counter()))
        visual.register_forward_hook(
            lambda *a: setattr(self, "encode", time.perf_counter() - self._t)
        )

    @torch.inference_mode()
    def __call__(self, image) -> dict[str, float]:
        t0 = time.perf_counter()
        inputs = self.proc(text=[PROMPT], images=[image], return_tensors="pt")
        pre = time.perf_counter() - t0
        self.model.model.rope_deltas = None  # Qwen3.5 keeps the last request's offset
        self.model.generate(**inputs, max_new_tokens=1, do_sample=False)
        total = time.perf_counter() - t0
        return {"preprocess": pre, "encode": self.encode, "prefill": total - pre - self.encode,
                "ttft": total}  # fmt: skip


def ttft_table(path: Path, size: int, rounds: int, family: str) -> list[list[str]]:
    ours, theirs = TokenmillTTFT(path), TransformersTTFT(path, family)
    ours(random_image(size, size, 999))  # warm-up (allocations, first-call costs)
    theirs(random_image(size, size, 999))
    runs: dict[str, list[dict[str, float]]] = {"tokenmill": [], "transformers": []}
    for r in range(rounds):
        image = random_image(size, size, r)
        runs["tokenmill"].append(ours(image))
        runs["transformers"].append(theirs(image))
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in runs.items()}
    rows = [["engine", "preprocess ms", "encode ms", "prefill ms", "TTFT ms", "preprocess share"]]
    for name, m in med.items():
        rows.append([name, *(f"{m[f] * 1e3:.0f}" for f in ("preprocess", "encode", "prefill", "ttft")),
                     f"{m['preprocess'] / m['ttft']:.0%}"])  # fmt: skip
    speedup = med["transformers"]["ttft"] / med["tokenmill"]["ttft"]
    rows.append(["speed-up", "", "", "", f"{speedup:.2f}x", ""])
    del ours
    return rows


def text_ttft_under_load(path: Path, size: int, load: int, rounds: int) -> list[list[str]]:
    from tokenmill import LLM, SamplingParams
    from tokenmill.sampling_params import RequestOutputKind

    llm = LLM(
        str(path), dtype="float32", device="cpu", max_model_len=4096, enable_prefix_caching=False
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, output_kind=RequestOutputKind.DELTA)
    proc = engine.mm_processor
    tok = llm.tokenizer

    def run(with_images: bool) -> float:
        from tokenmill.engine.request import RequestOptions

        jobs = []
        tag = f"{time.perf_counter_ns()}"  # fresh request ids every run
        if with_images:  # preprocessed before the clock starts (a server's pool does it)
            for i in range(load):
                ids, mm = proc.process(
                    tok.encode(PROMPT), {"image": random_image(size, size, 100 + i)}, proc.defaults
                )
                jobs.append((f"img{i}-{tag}", ids, RequestOptions(multimodal=mm)))  # fmt: skip
        texts = [
            (f"txt{i}-{tag}", tok.encode(TEXT.format(i)), RequestOptions()) for i in range(load)
        ]
        order = [j for pair in zip(jobs, texts) for j in pair] if jobs else texts  # interleaved
        first: dict[str, float] = {}
        t0 = time.perf_counter()
        for rid, ids, opts in order:
            engine.add_request(ids, params.clone(), rid, options=opts)
        waiting = {rid for rid, _, _ in texts}
        while waiting and engine.has_unfinished():
            for out in engine.step():
                if out.request_id not in first and out.outputs[0].token_ids:
                    first[out.request_id] = time.perf_counter() - t0
                    waiting.discard(out.request_id)
        for rid, _, _ in order:  # the image requests need not finish
            engine.abort(rid)
        return statistics.median(v for k, v in first.items() if k.startswith("txt"))

    run(False)  # warm-up
    pairs = [(run(False), run(True)) for _ in range(rounds)]  # alternating: the noise is shared
    alone = statistics.median(a for a, _ in pairs)
    loaded = statistics.median(b for _, b in pairs)
    return [["text requests", "median TTFT ms"], [f"{load} alone", f"{alone * 1e3:.0f}"],
            [f"{load} + {load} image requests", f"{loaded * 1e3:.0f}"],
            ["ratio", f"{loaded / alone:.2f}x"]]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", type=int, default=1024, help="image side in pixels")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", type=int, default=8, help="image and text requests in part 2")
    ap.add_argument("--vision-depth", type=int, default=8)
    ap.add_argument("--family", choices=sorted(CHECKPOINTS), default="qwen2_5_vl")
    ap.add_argument("--skip-ttft", action="store_true", help="only part 2 (text under image load)")
    ap.add_argument("--skip-load", action="store_true", help="only part 1 (one image's TTFT)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tokenmill-bench")
    args = ap.parse_args()
    path = make_checkpoint(args.cache, args.vision_depth, args.family)
    print(f"threads {torch.get_num_threads()}, image {args.size}x{args.size}, model {path.name}")
    if not args.skip_ttft:
        print(table(ttft_table(path, args.size, args.rounds, args.family)))
    if not args.skip_load:
        print(table(text_ttft_under_load(path, args.size, args.load, args.rounds)))


if __name__ == "__main__":
    main()
