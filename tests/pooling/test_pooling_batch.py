"""``tokenmill run-batch`` over a pooling model: /v1/embeddings lines (the batch format's
embeddings url) and /v1/score lines, batched through the pooling engine."""

from __future__ import annotations

import json

from tokenmill import LLM
from tokenmill.entrypoints.run_batch import run_batch


def test_embedding_and_score_lines(tmp_path, minilm_dir):
    lines = [
        {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": ["A man is eating food.", "A cat sleeps."]}},
        {"custom_id": "s1", "method": "POST", "url": "/v1/score",
         "body": {"text_1": "A man is eating food.", "text_2": ["A man eats.", "Rain."]}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": []}},
        {"custom_id": "gen", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "max_tokens": 2}},
    ]  # fmt: skip
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    counts = run_batch(src, dst, lambda: LLM(str(minilm_dir)))
    assert counts == {"skipped": 0, "invalid": 0, "ok": 2, "failed": 2}
    out = {json.loads(t)["custom_id"]: json.loads(t) for t in dst.read_text().splitlines()}
    emb = out["e1"]["response"]["body"]
    assert emb["object"] == "list" and [len(d["embedding"]) for d in emb["data"]] == [384, 384]
    with LLM(str(minilm_dir)) as llm:
        want = [o.outputs.embedding for o in llm.embed(["A man is eating food.", "A cat sleeps."])]
    for got, ref in zip(emb["data"], want):
        assert max(abs(a - b) for a, b in zip(got["embedding"], ref)) < 1e-5
    scores = [d["score"] for d in out["s1"]["response"]["body"]["data"]]
    assert len(scores) == 2 and scores[0] > scores[1]
    assert out["bad"]["response"]["status_code"] == 400
    assert out["gen"]["response"]["status_code"] == 400  # a pooling model generates nothing
