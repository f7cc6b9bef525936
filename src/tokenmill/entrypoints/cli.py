"""`tokenmill generate | chat`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.entrypoints.args import (
    ENGINE_FLAGS,
    SAMPLING_FLAGS,
    add_flags,
    engine_options,
    sampling_options,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="Run LLMs from Hugging Face folders or GGUF files on CPU or CUDA.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="complete one prompt and print the text",
                         description="Complete a prompt (streamed as it is generated).")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--chat-template", action="store_true",
                     help="wrap the prompt as a user message with the model's chat template")
    chat = sub.add_parser("chat", help="interactive chat that streams the answer",
                          description="Interactive chat. Type /reset to start over, /exit or Ctrl-D to quit.")
    chat.add_argument("--system", help="system prompt for the conversation")
    for p in (gen, chat):
        add_flags(p.add_argument_group("engine"), ENGINE_FLAGS)
        add_flags(p.add_argument_group("sampling"), SAMPLING_FLAGS, prefix="s_")
        p.add_argument("--quiet", action="store_true", help="no loading progress on stderr")
    return parser


def _version() -> str:
    from tokenmill import __version__

    return f"tokenmill {__version__}"


def _make_llm(args: argparse.Namespace):
    from tokenmill import LLM

    return LLM(args.model, **engine_options(args))


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
        prompt = {"prompt_token_ids": llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}])}
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


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
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
