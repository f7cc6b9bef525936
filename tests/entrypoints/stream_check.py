"""Rebuild a streamed chat message from ChatStreamer deltas, as an OpenAI client does, and
the non-streamed one, to compare them (a unique module name: test folders share sys.path)."""

from __future__ import annotations

from tokenmill.entrypoints.openai.chat_output import ChatOutputParser, ChatStreamer


def assemble(output: ChatOutputParser, chunks: list[str]) -> dict:
    """What an OpenAI client rebuilds from the stream."""
    streamer = ChatStreamer(output)
    msg: dict = {"content": "", "reasoning": "", "calls": []}
    for i, chunk in enumerate(chunks):
        delta = streamer.feed(chunk, final=i == len(chunks) - 1)
        msg["content"] += delta.content
        msg["reasoning"] += delta.reasoning
        for call in delta.calls:
            if call["index"] == len(msg["calls"]):
                msg["calls"].append([call["function"]["name"], ""])
            msg["calls"][call["index"]][1] += call["function"]["arguments"]
    return msg


def full(output: ChatOutputParser, text: str) -> dict:
    parts = output.parse(text, final=True)
    return {
        "content": parts.content,
        "reasoning": parts.reasoning or "",
        "calls": [[c.name, c.arguments] for c in parts.calls],
    }


def check_every_boundary(output: ChatOutputParser, text: str) -> None:
    """Cut ``text`` once at every position, and into single characters: same message."""
    expected = full(output, text)
    assert assemble(output, [text]) == expected
    for cut in range(len(text) + 1):
        assert assemble(output, [text[:cut], text[cut:]]) == expected, cut
    assert assemble(output, list(text) + [""]) == expected
