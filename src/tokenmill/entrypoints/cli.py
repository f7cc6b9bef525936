"""`tokenmill generate | chat | serve | run-batch | cache`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.bundles import commands as cache_commands
from tokenmill.entrypoints import run_batch
from tokenmill.entrypoints.args import (
    SAMPLING_FLAGS,
    SERVER_FLAGS,
    add_engine_flags,
    add_flags,
    engine_options,
    sampling_options,
    server_options,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="Run LLMs from Hugging Face folders or GGUF files on CPU or CUDA.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="complete one prompt and print the text",
        description="Complete a prompt (streamed as it is generated).",
    )
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument(
        "--chat-template",
        action="store_true",
        help="wrap the prompt as a user message with the model's chat template",
    )
    chat = sub.add_parser(
        "chat",
        help="interactive chat that streams the answer",
        description="Interactive chat. Type /reset to start over, /exit or Ctrl-D to quit.",
    )
    chat.add_argument("--system", help="system prompt for the conversation")
    for p in (gen, chat):
        add_engine_flags(p.add_argument_group("engine"))
        add_flags(p.add_argument_group("sampling"), SAMPLING_FLAGS, prefix="s_")
        p.add_argument("--quiet", action="store_true", help="no loading progress on stderr")
    add_serve_flags(_add_serve(sub))
    batch = run_batch.add_parser(sub)
    add_engine_flags(batch.add_argument_group("engine"))
    cache_commands.add_parser(sub)
    return parser


def _add_serve(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (default: the embedded SmolLM2-135M-Instruct) over an "
        "OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models, "
        "/tokenize, /detokenize, /health, /metrics, /version. The first SIGTERM or Ctrl-C "
        "drains (finishes accepted requests, refuses new ones with 503); a second one exits "
        "at once.",
    )


def add_serve_flags(serve: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``tokenmill serve``'s arguments (also those of ``python -m
    tokenmill.entrypoints.openai.api_server``)."""
    serve.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        help="HF checkpoint folder or .gguf file (same as --model)",
    )
    add_flags(serve.add_argument_group("server"), SERVER_FLAGS)
    from tokenmill.entrypoints.openai.limits import LIMIT_FLAGS

    add_flags(serve.add_argument_group("limits"), LIMIT_FLAGS)
    add_engine_flags(
        serve.add_argument_group(
            "engine", "vLLM's engine flags are accepted too: each says what it means here"
        )
    )
    return serve


def _version() -> str:
    from tokenmill import __version__

    return f"tokenmill {__version__}"


def _make_llm(args: argparse.Namespace):
    from tokenmill import LLM

    llm = LLM(args.model, **engine_options(args))
    # Loaded: from here the answer streams to the terminal, and the engine's per-request
    # INFO lines (a server log's business) would land in the middle of it.
    logging.getLogger("tokenmill.engine").setLevel(max(logging.WARNING, logging.root.level))
    return llm


def _params(llm, args: argparse.Namespace):
    from tokenmill import RequestOutputKind

    params = llm.get_default_sampling_params()
    for key, value in sampling_options(args).items():
        setattr(params, key, value)
    params.output_kind = RequestOutputKind.DELTA
    params.__post_init__()  # re-validate after the overrides
    return params


def _stream(llm, prompt, params) -> str:
    text = []
    for out in llm.generate_stream(prompt, params):
        delta = out.outputs[0].text
        text.append(delta)
        print(delta, end="", flush=True)
    print()
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _params(llm, args)
    prompt = args.prompt
    if args.chat_template:
        prompt = {
            "prompt_token_ids": llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}]
            )
        }
    _stream(llm, prompt, params)
    llm.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _params(llm, args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    print("tokenmill chat: /reset starts over, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = list(start)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = llm.tokenizer.apply_chat_template(history)
        try:
            answer = _stream(llm, {"prompt_token_ids": ids}, params)
        except ValueError as exc:  # e.g. the conversation outgrew max_model_len
            print(f"error: {exc}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})
    llm.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.engine.core_process import use_engine_process
    from tokenmill.entrypoints.openai.launcher import OpenAIServer
    from tokenmill.entrypoints.openai.limits import limit_options
    from tokenmill.entrypoints.openai.state import ServerConfig, model_name_of

    if args.model_arg and args.model and args.model_arg != args.model:
        raise ValueError(f"two models given: {args.model_arg!r} and --model {args.model!r}")
    model = args.model_arg or args.model
    options = engine_options(args)
    config = ServerConfig(**server_options(args), limits=limit_options(args))
    name = model_name_of(model, options.get("served_model_name"))
    if model and _is_speech_model(model):  # Whisper or a Piper voice: the speech server
        from tokenmill.entrypoints.openai.serving_speech import serve_speech

        return serve_speech(model, config, name)
    engine_config = _engine_config(model, options)  # refuse before loading (in a thread)
    replicas = engine_config.parallel.data_parallel_size > 1  # the server starts them
    if replicas or use_engine_process(config.engine_process, engine_config):
        return OpenAIServer(engine_config, config, model_name=name).run()

    def load():
        from tokenmill import LLM

        return LLM(model, **options).engine

    return OpenAIServer(load, config, model_name=name).run()


def _is_speech_model(model: str) -> bool:
    from tokenmill.speech.detect import is_speech_model

    return is_speech_model(model) is not None


def _engine_config(model: str | None, options: dict):
    """The EngineConfig ``LLM(model, **options)`` would build (vLLM-only options dropped)."""
    from tokenmill.config import EngineConfig
    from tokenmill.vllm_compat import check_compat_options

    options = dict(options)
    check_compat_options(options)
    return EngineConfig(model=model, **options)


def cmd_run_batch(args: argparse.Namespace) -> int:
    return run_batch.cmd_run_batch(args, lambda: _make_llm(args))


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "serve": cmd_serve,
    "run-batch": cmd_run_batch,
    "cache": cache_commands.cmd_cache,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING if getattr(args, "quiet", False) else logging.INFO
    if args.command == "serve":
        level = getattr(logging, args.log_level.upper())
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return COMMANDS[args.command](args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
