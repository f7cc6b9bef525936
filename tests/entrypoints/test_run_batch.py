"""``tokenmill run-batch``: OpenAI's batch format, good and bad lines, resuming."""

from __future__ import annotations

import json

from _serving_helpers import MODEL, tiny_engine_llm
from openai_schema import check

from tokenmill.entrypoints.cli import main as cli_main
from tokenmill.entrypoints.run_batch import run_batch

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
LINES = [
    {
        "custom_id": "chat-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, **CHAT},
    },
    {
        "custom_id": "cmpl-1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "Once", "max_tokens": 3},
    },  # no model: the served one
    {
        "custom_id": "refused",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {**CHAT, "temperature": -1},
    },
    {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    {"custom_id": "streamed", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}},
    {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
]


def _write(path, lines, extra: str = "") -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + extra)


def _read(path) -> dict:
    return {
        json.loads(line)["custom_id"]: json.loads(line) for line in path.read_text().splitlines()
    }


def test_good_and_bad_lines_then_resume(tmp_path, tiny_llama_dir):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, LINES, "{not json\n")
    loads = []

    def factory():
        loads.append(1)
        return tiny_engine_llm(tiny_llama_dir)

    counts = run_batch(src, dst, factory)
    assert counts == {"skipped": 0, "invalid": 4, "ok": 2, "failed": 2}
    lines = dst.read_text().splitlines()
    assert len(lines) == len(LINES) + 1  # one output line per input line
    out = _read(dst)
    assert out["chat-1"]["error"] is None and out["chat-1"]["id"].startswith("batch_req_")
    check("chat.completion", out["chat-1"]["response"]["body"])
    check("text_completion", out["cmpl-1"]["response"]["body"])
    assert out["refused"]["response"]["status_code"] == 400
    check("error", out["refused"]["response"]["body"])
    assert out["emb"]["response"]["status_code"] == 400  # a generative model embeds nothing
    check("error", out["emb"]["response"]["body"])
    assert out["streamed"]["error"]["code"] == "invalid_body"
    codes = sorted(
        json.loads(line)["error"]["code"] for line in lines if json.loads(line)["custom_id"] is None
    )
    assert codes == ["invalid_json", "missing_custom_id"]
    assert [
        json.loads(line)["error"]["code"]
        for line in lines
        if json.loads(line)["custom_id"] == "chat-1" and json.loads(line)["error"]
    ] == ["duplicate_custom_id"]
    # Resumed: nothing left to do, nothing loaded, nothing written.
    assert run_batch(src, dst, factory)["skipped"] == len(LINES) + 1 and len(loads) == 1
    assert len(dst.read_text().splitlines()) == len(lines)
    _write(src, [*LINES[:2], {**LINES[0], "custom_id": "chat-2"}])
    again = run_batch(src, dst, factory)
    assert again["ok"] == 1 and again["skipped"] == 2 and "chat-2" in _read(dst)


def test_cli(tmp_path, tiny_llama_dir, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, LINES[:1])
    assert (
        cli_main(
            [
                "run-batch",
                "-i",
                str(src),
                "-o",
                str(dst),
                "--model",
                str(tiny_llama_dir),
                "--dtype",
                "float32",
                "--max-model-len",
                "128",
                "--num-kv-blocks",
                "64",
                "--block-size",
                "4",
            ]
        )
        == 0
    )
    assert "0 answered, 1 refused by the API" in capsys.readouterr().out
    [line] = dst.read_text().splitlines()
    assert json.loads(line)["response"]["status_code"] == 404  # the model is named "tiny"
