"""``tokenmill run-batch -i requests.jsonl -o results.jsonl``: OpenAI's batch file format
run offline.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with url
/v1/chat/completions or /v1/completions. All lines go to one in-process server at once
(so the engine batches them), each through the same code as an HTTP request. Every
input line gives one output line, in completion order and flushed at once:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}``;
a request the API refuses keeps its status code and error body; a line that can not be
run at all (bad JSON, no custom_id, another url or method, stream) gets ``"response":
null`` and ``"error": {"code", "message"}``. Resumable: custom_ids already in the output
file are skipped and new lines are appended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")
"""Generation routes for a generative model, pooling routes for a pooling one (the other
kind's route answers a 400 line that says which model serves what)."""
MAX_IN_FLIGHT = 256
"""Requests sent to the in-process server at once (the engine batches what runs)."""


@dataclass(frozen=True)
class BatchLine:
    custom_id: str | None
    url: str | None
    body: dict[str, Any] | None
    error: dict[str, str] | None
    """Set when the line can not be run (it becomes an error line)."""


def parse_line(line: str, number: int) -> BatchLine:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        return BatchLine(None, None, None, _error("invalid_json", f"line {number}: {exc}"))
    if not isinstance(item, dict):
        return BatchLine(
            None, None, None, _error("invalid_request", f"line {number} is not a JSON object")
        )
    cid, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    if not isinstance(cid, str) or not cid:
        return BatchLine(
            None, url, None, _error("missing_custom_id", f"line {number}: no custom_id string")
        )
    if item.get("method", "POST") != "POST":
        return BatchLine(cid, url, None, _error("invalid_method", "method must be POST"))
    if url not in URLS:
        return BatchLine(
            cid,
            url,
            None,
            _error("invalid_url", f"url {url!r} is not supported; use one of {', '.join(URLS)}"),
        )
    if not isinstance(body, dict):
        return BatchLine(cid, url, None, _error("invalid_body", "body must be a JSON object"))
    if body.get("stream"):
        return BatchLine(
            cid, url, None, _error("invalid_body", "stream is not supported in a batch")
        )
    return BatchLine(cid, url, body, None)


def _error(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def done_ids(output: Path) -> set[str]:
    """custom_ids that already have an output line, and the error messages of lines that
    had none (they name their line number): a resumed run skips both."""
    if not output.exists():
        return set()
    ids = set()
    for line in output.read_text().splitlines():
        try:
            item = json.loads(line)
            cid = item.get("custom_id")
        except (json.JSONDecodeError, AttributeError):
            continue  # a line cut by a crash: its request runs again
        if isinstance(cid, str):
            ids.add(cid)
        elif isinstance(item.get("error"), dict):
            ids.add(item["error"].get("message"))
    return ids


def output_line(
    cid: str | None, response: dict[str, Any] | None, error: dict[str, str] | None
) -> str:
    return (
        json.dumps(
            {
                "id": f"batch_req_{uuid.uuid4().hex}",
                "custom_id": cid,
                "response": response,
                "error": error,
            }
        )
        + "\n"
    )


async def _run(
    url: str, lines: list[BatchLine], out, default_model: str, progress
) -> dict[str, int]:
    import httpx

    counts = {"ok": 0, "failed": 0}
    limit = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(client: httpx.AsyncClient, item: BatchLine) -> None:
        async with limit:
            body = {"model": default_model, **item.body}  # type: ignore[dict-item]
            r = await client.post(item.url, json=body)  # type: ignore[arg-type]
        response = {
            "status_code": r.status_code,
            "request_id": r.headers.get("x-request-id", f"req_{uuid.uuid4().hex}"),
            "body": r.json(),
        }
        counts["ok" if r.status_code == 200 else "failed"] += 1
        out.write(output_line(item.custom_id, response, None))
        out.flush()
        progress.update(1)

    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        await asyncio.gather(*(one(client, item) for item in lines))
    return counts


def run_batch(input_path: Path, output_path: Path, llm_factory) -> dict[str, int]:
    """Run every not yet answered line of ``input_path``; returns counts of lines."""
    from tqdm.auto import tqdm

    from tokenmill.entrypoints.openai.launcher import OpenAIServer
    from tokenmill.entrypoints.openai.state import ServerConfig

    skip = done_ids(output_path)
    lines = [
        parse_line(text, i + 1)
        for i, text in enumerate(input_path.read_text().splitlines())
        if text.strip()
    ]
    seen: set[str] = set()
    todo, bad = [], []
    for item in lines:
        if (
            item.custom_id if item.custom_id is not None else item.error["message"]  # type: ignore[index]
        ) in skip:
            continue
        if item.error is None and item.custom_id in seen:
            item = BatchLine(
                item.custom_id,
                item.url,
                None,
                _error("duplicate_custom_id", f"custom_id {item.custom_id!r} appears twice"),
            )
        seen.add(item.custom_id or "")
        (bad if item.error is not None else todo).append(item)
    counts = {
        "skipped": len(lines) - len(todo) - len(bad),
        "invalid": len(bad),
        "ok": 0,
        "failed": 0,
    }
    with output_path.open("a") as out:
        for item in bad:
            out.write(output_line(item.custom_id, None, item.error))
        out.flush()
        if not todo:
            return counts
        llm = llm_factory()
        srv = OpenAIServer(
            llm.engine, ServerConfig(port=0, log_level="warning", max_queued_requests=None)
        ).start()
        try:
            with tqdm(total=len(todo), desc="Batch requests", unit="req") as progress:
                counts.update(asyncio.run(_run(srv.url, todo, out, srv.state.model_name, progress)))
        finally:
            srv.close(timeout=60)
            llm.close()
    return counts


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL) offline",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-i",
        "--input-file",
        required=True,
        type=Path,
        help="JSONL requests: {custom_id, method, url, body} per line",
    )
    p.add_argument(
        "-o",
        "--output-file",
        required=True,
        type=Path,
        help="JSONL results, appended (lines whose custom_id is there are skipped)",
    )
    return p


def cmd_run_batch(args: argparse.Namespace, llm_factory) -> int:
    counts = run_batch(args.input_file, args.output_file, llm_factory)
    print(
        f"run-batch: {counts['ok']} answered, {counts['failed']} refused by the API, "
        f"{counts['invalid']} invalid lines, {counts['skipped']} already done "
        f"-> {args.output_file}"
    )
    return 0
