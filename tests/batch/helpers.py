"""Shared by the batch tests that run engines: a tiny model, a mixed input file, comparable outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.config import EngineConfig

MODEL_NAME = "tiny"
# Small KV pools: several engines share the 2-core test machine.
ENGINE = {"max_model_len": 128, "kv_cache_memory_bytes": 1 << 24, "swap_space": 0.01}


def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, **ENGINE)  # type: ignore[arg-type]


def _row(cid: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def mixed_rows(num_plain: int = 6, max_tokens: int = 6) -> list[dict[str, Any]]:
    """Both urls, n=2 (seeded), logprobs, stop strings, and rows the server would answer with a 400."""
    rows = [
        _row(f"plain-{i}", "/v1/completions", {"prompt": f"row {i}:", "max_tokens": max_tokens, "temperature": 0})
        for i in range(num_plain)
    ]
    rows += [
        _row("logprobs", "/v1/completions", {"prompt": "abc", "max_tokens": 4, "temperature": 0, "logprobs": 2}),
        _row("stop", "/v1/completions", {"prompt": "xyz", "max_tokens": 12, "temperature": 0, "stop": ["a", "e"]}),
        _row("n2", "/v1/completions", {"prompt": "two", "max_tokens": 5, "n": 2, "seed": 7, "temperature": 0.9}),
        _row(
            "chat",
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
        _row("chat-n2", "/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}], "n": 2, "seed": 1}),
        _row("bad-temperature", "/v1/completions", {"prompt": "x", "temperature": -1}),
        _row("bad-stream", "/v1/completions", {"prompt": "x", "stream": True}),
        _row("too-long", "/v1/completions", {"prompt": "y" * 400, "max_tokens": 2}),
        _row("bad-field", "/v1/chat/completions", {"messages": "not a list"}),
    ]
    return rows


BAD_IDS = {"bad-temperature", "bad-stream", "too-long", "bad-field"}


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_lines(*paths: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in paths:
        if p.exists():
            out += [json.loads(x) for x in p.read_text().splitlines()]
    return out


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    """A response body without what differs between any two answers: its id, creation time and tool call ids."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    for choice in out.get("choices") or []:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id", None)
    return out


def by_id(lines: list[dict[str, Any]]) -> dict[str, tuple[int, dict[str, Any]]]:
    """custom_id -> (status, comparable body); asserts each custom_id appears exactly once."""
    ids = [x["custom_id"] for x in lines]
    assert len(ids) == len(set(ids)), f"custom_ids repeated: {sorted(i for i in ids if ids.count(i) > 1)}"
    return {x["custom_id"]: (x["response"]["status_code"], comparable(x["response"]["body"])) for x in lines}
