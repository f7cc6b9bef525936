"""What vLLM users write, with only ``vllm`` -> ``tokenmill`` changed: an offline script
built on EngineArgs + FlexibleArgumentParser, LLM options and outputs, SamplingParams'
vLLM names, and the common ``vllm serve`` flags."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tokenmill import LLM, EngineArgs, GuidedDecodingParams, SamplingParams, TokensPrompt
from tokenmill.entrypoints.cli import build_parser
from tokenmill.entrypoints.cli import main as cli_main
from tokenmill.errors import InvalidRequestError
from tokenmill.utils import FlexibleArgumentParser

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _offline_script(argv: list[str]) -> list[str]:
    """An offline-inference script in vLLM's style (our own, written for this test)."""
    parser = FlexibleArgumentParser(description="offline inference")
    EngineArgs.add_cli_args(parser)
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=5)
    group.add_argument("--temperature", type=float, default=0.0)
    args = vars(parser.parse_args(argv))
    sampling = SamplingParams(
        max_tokens=args.pop("max_tokens"), temperature=args.pop("temperature"), ignore_eos=True
    )
    llm = LLM(**args)
    try:
        outputs = llm.generate(["Hello, my name is", "The capital of France is"], sampling)
        return [o.outputs[0].text for o in outputs]
    finally:
        llm.close()


def test_a_vllm_style_script_runs(tiny_llama_dir):
    texts = _offline_script(
        [
            "--model",
            str(tiny_llama_dir),
            "--dtype",
            "float32",
            "--max_model_len",
            "128",
            "--num-kv-blocks",
            "64",
            "--block-size",
            "4",
            "--trust-remote-code",
            "--gpu-memory-utilization",
            "0.5",
            "-tp",
            "1",
        ]
    )
    assert len(texts) == 2 and all(texts)
    args = EngineArgs.from_cli_args(
        EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
            ["--model", "m", "--no-enable-prefix-caching"]
        )
    )
    assert args.model == "m" and args.enable_prefix_caching is False
    assert args.create_engine_config().enable_prefix_caching is False
    assert "tensor_parallel_size" in {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize(
    "option",
    [
        {"kv_cache_dtype": "fp8"},
        {"enable_lora": True},
    ],
)
def test_options_that_would_change_results_are_refused(tiny_llama_dir, option):
    with pytest.raises(ValueError, match=next(iter(option))):
        LLM(str(tiny_llama_dir), dtype="float32", **option)
    with pytest.raises(ValueError, match=next(iter(option))):
        EngineArgs(**option).create_engine_config()


def test_outputs_carry_what_vllm_fills(tiny_llm):
    assert tiny_llm.llm_engine is tiny_llm.engine
    assert tiny_llm.get_tokenizer().decode(tiny_llm.get_tokenizer().encode("hi")).endswith("hi")
    [out] = tiny_llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert out.finished and out.prompt and "Hi" in out.prompt
    assert (
        tiny_llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
        == out.prompt_token_ids
    )
    m = out.metrics
    assert m["arrival_time"] <= m["finished_time"] and m["e2e_latency"] >= 0
    streamed = list(tiny_llm.generate_stream("Hello", GREEDY))
    assert streamed[-1].metrics["first_token_time"] <= streamed[-1].metrics["finished_time"]
    [scored] = tiny_llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=3, logprobs=0), use_tqdm=False
    )
    comp = scored.outputs[0]
    chosen = sum(pos[t].logprob for t, pos in zip(comp.token_ids, comp.logprobs))
    assert comp.cumulative_logprob == pytest.approx(chosen, abs=1e-4)


def test_use_tqdm_shows_a_progress_bar(tiny_llm, capsys):
    tiny_llm.generate(["a", "b", "c"], GREEDY)  # the default, as in vLLM
    assert "Processed prompts" in capsys.readouterr().err
    tiny_llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    updates = []

    class Bar:
        def __init__(self, total, **_):
            updates.append(("total", total))

        def update(self, n):
            updates.append(n)

        def close(self):
            updates.append("closed")

    tiny_llm.generate(["a", "b"], GREEDY, use_tqdm=Bar)
    assert updates == [("total", 2), 1, 1, "closed"]


def test_sampling_params_vllm_names(tiny_llm):
    ids = tiny_llm.get_tokenizer().encode("one two three four five six seven")
    [cut] = tiny_llm.generate(
        TokensPrompt(prompt_token_ids=ids),
        SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3),
        use_tqdm=False,
    )
    assert cut.prompt_token_ids == ids[-3:]
    allowed = [5, 17, 42]
    [out] = tiny_llm.generate(
        "Hello",
        SamplingParams(
            temperature=1.0, seed=0, max_tokens=8, allowed_token_ids=allowed, ignore_eos=True
        ),
        use_tqdm=False,
    )
    assert set(out.outputs[0].token_ids) <= set(allowed) and len(out.outputs[0].token_ids) == 8
    seen = []

    def force_7(prompt_ids, output_ids, logits):
        seen.append((len(prompt_ids), len(output_ids)))
        forced = torch.full_like(logits, -1e9)
        forced[7] = 0
        return forced

    [forced] = tiny_llm.generate(
        "Hello",
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logits_processors=[force_7]),
        use_tqdm=False,
    )
    assert forced.outputs[0].token_ids == [7, 7, 7, 7]
    assert [n for _, n in seen] == [0, 1, 2, 3]
    [two_args] = tiny_llm.generate(
        "Hello",
        SamplingParams(
            temperature=0,
            max_tokens=2,
            ignore_eos=True,
            logits_processors=[
                lambda out_ids, logits: logits.index_fill(
                    0, torch.tensor([t for t in range(logits.numel()) if t != 9]), float("-inf")
                )
            ],
        ),
        use_tqdm=False,
    )
    assert two_args.outputs[0].token_ids == [9, 9]


def test_sampling_params_refusals_and_aliases():
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=1, best_of=3)
    assert SamplingParams(n=2, best_of=2).best_of == 2
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams(bad_words=[""])
    assert SamplingParams(bad_words=["darn"]).bad_words == ["darn"]  # see tests/sampling
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(InvalidRequestError, match="callables"):
        SamplingParams(logits_processors=["nope"])
    guide = GuidedDecodingParams(choice=["yes", "no"])
    p = SamplingParams(guided_decoding=guide)
    assert p.structured_outputs is guide and p.guided_decoding is guide
    with pytest.raises(InvalidRequestError, match="not both"):
        SamplingParams(guided_decoding=guide, structured_outputs=GuidedDecodingParams(regex="a+"))


COMMON_VLLM_SERVE_FLAGS = [
    "--host",
    "127.0.0.1",
    "--port",
    "8001",
    "--api-key",
    "k",
    "--served-model-name",
    "m",
    "--tokenizer",
    "t",
    "--dtype",
    "auto",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "1024",
    "--block-size",
    "16",
    "--seed",
    "1",
    "--enforce-eager",
    "--quantization",
    "auto",
    "--gpu-memory-utilization",
    "0.8",
    "--tensor-parallel-size",
    "1",
    "--pipeline-parallel-size",
    "1",
    "--trust-remote-code",
    "--chat-template",
    "{{ messages }}",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--reasoning-parser",
    "none",
    "--generation-config",
    "vllm",
    "--no-enable-prefix-caching",
    "--max-logprobs",
    "5",
    "--disable-log-requests",
    "--disable-log-stats",
    "--uvicorn-log-level",
    "warning",
    "--max-log-len",
    "100",
    "--swap-space",
    "4",
    "--enable-chunked-prefill",
    "true",
    "--load-format",
    "auto",
    "--kv-cache-dtype",
    "auto",
    "--download-dir",
    "/tmp",
    "--max_num_seqs",
    "8",
]


def test_common_vllm_serve_flags_parse():
    args = build_parser().parse_args(["serve", "model.gguf", *COMMON_VLLM_SERVE_FLAGS[:-2]])
    assert args.enable_prefix_caching is False and args.max_logprobs == 5
    assert args.chat_template == "{{ messages }}" and args.uvicorn_log_level == "warning"
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "gpu-memory-utilization" in help_text and "no-op" in help_text


def test_serve_refuses_tensor_parallel_before_loading(capsys):
    # SmolLM2-135M (the default model) has 9 query heads: 2 ranks can not split them
    assert cli_main(["serve", "--tensor-parallel-size", "2"]) == 2
    assert "tensor_parallel_size=2 can not split" in capsys.readouterr().err


def test_api_server_module_is_an_alias_of_serve(capsys):
    from tokenmill.entrypoints.openai import api_server

    with pytest.raises(SystemExit) as done:
        api_server.main(["--help"])
    assert done.value.code == 0 and "--chat-template" in capsys.readouterr().out
    assert api_server.main(["--model", "x", "-tp", "4"]) == 2


def test_no_op_options_are_logged(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.vllm_compat"):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            max_model_len=64,
            num_kv_blocks=16,
            block_size=4,
            swap_space=8,
            generation_config="vllm",
        )
    try:
        assert "swap_space=8 has no effect" in caplog.text
        assert llm.get_default_sampling_params() == SamplingParams()
    finally:
        llm.close()
