"""One engine replica answering Ray Dataset rows for `build_processor` (see processor.py).

A `BatchReplica` underneath: each row's request is wrapped as an OpenAI batch line and answered by
`BatchReplica._answer`, i.e. by the HTTP server's request models and handlers over the engine's one
output stream; this class only turns the resulting `BatchRequestOutput` line into columns. So a row's
`response` is the body `POST /v1/...` returns for the same request, and its error is the server's 400.

Decisions:
- The batch arrives as a pyarrow Table and the new columns are appended to it, so the user's columns
  (nested lists, structs, anything Arrow holds) travel through untouched, never via numpy.
- Rows whose engine died (503 engine_unavailable) are redone here on a fresh engine, up to
  `ENGINE_ATTEMPTS` times; there is no journal on this path, so this replica must not drop them.
  A row still unanswered after that carries the 503's error, like any other failed row.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pyarrow as pa

from cluster.config import EngineConfig
from raytp.batch.replica import BatchReplica

REQUEST_COLUMN = "__raytp_request"  # the row's request as JSON, made by processor.request_of
ENGINE_ATTEMPTS = 3
# Output columns and their Arrow types (fixed, so blocks whose rows all failed still share one schema).
OUTPUT_COLUMNS: dict[str, pa.DataType] = {
    "generated_text": pa.string(),
    "num_input_tokens": pa.int64(),
    "num_generated_tokens": pa.int64(),
    "finish_reason": pa.string(),
    "error": pa.string(),
    "status_code": pa.int64(),
    "request_id": pa.string(),
    "response": pa.string(),  # the whole OpenAI response (or error) body as JSON: n > 1, logprobs, ...
}


def columns_of(line: dict[str, Any]) -> dict[str, Any]:
    """One BatchRequestOutput line -> the row's output columns (choice 0 gives the text)."""
    resp = line["response"]
    body = resp["body"] or {}
    out: dict[str, Any] = {
        "generated_text": None,
        "num_input_tokens": None,
        "num_generated_tokens": None,
        "finish_reason": None,
        "error": None,
        "status_code": int(resp["status_code"]),
        "request_id": resp["request_id"],
        "response": json.dumps(body, ensure_ascii=False),
    }
    if line["error"] is not None:
        out["error"] = line["error"]["message"]
        return out
    first = body["choices"][0]
    text = first["text"] if "text" in first else first["message"]["content"]
    usage = body["usage"]
    out.update(
        generated_text=text,
        num_input_tokens=int(usage["prompt_tokens"]),
        num_generated_tokens=int(usage["completion_tokens"]),  # all n choices together, as usage counts them
        finish_reason=first["finish_reason"],
    )
    return out


def _refused(message: str) -> dict[str, Any]:
    """The columns of a row that never reached a handler (no prompt / messages, see processor.py)."""
    return {**{name: None for name in OUTPUT_COLUMNS}, "error": message, "status_code": 400}


class RowReplica(BatchReplica):
    """Ray Data callable class: a pyarrow batch of rows -> the same rows plus OUTPUT_COLUMNS."""

    def __init__(self, engine_config: EngineConfig, max_concurrency: int) -> None:
        super().__init__(engine_config)
        self._max_concurrency = max_concurrency

    async def _answer_rows(self, texts: list[str]) -> list[tuple[str, str, dict[str, Any], bool]]:
        limit = asyncio.Semaphore(self._max_concurrency)

        async def one(text: str) -> tuple[str, str, dict[str, Any], bool]:
            async with limit:
                return await self._answer(0, text)

        return list(await asyncio.gather(*(one(t) for t in texts)))

    def _answer_with_retries(self, texts: dict[int, str]) -> dict[int, dict[str, Any]]:
        """Row index -> its output line; rows that met a dead engine are redone on a fresh one."""
        lines: dict[int, dict[str, Any]] = {}
        pending = dict(texts)
        for _ in range(ENGINE_ATTEMPTS):
            if self._engine_lost:
                self._start_engine()
            order = list(pending)
            results = self._loop.run_until_complete(self._answer_rows([pending[i] for i in order]))
            for i, (_, _, line, done) in zip(order, results, strict=True):
                lines[i] = line  # the last attempt's line stands, a 503 included
                if done:
                    del pending[i]
            if not pending:
                break
        return lines

    def __call__(self, batch: pa.Table) -> pa.Table:
        requests = batch.column(REQUEST_COLUMN).to_pylist()
        rows: dict[int, dict[str, Any]] = {}
        texts: dict[int, str] = {}
        for i, raw in enumerate(requests):
            req = json.loads(raw)
            if "error" in req:
                rows[i] = _refused(req["error"])
            else:  # an OpenAI batch line: BatchReplica answers exactly what `raytp batch` would
                texts[i] = json.dumps({"custom_id": f"row-{i}", "method": "POST", **req}, ensure_ascii=False)
        for i, line in self._answer_with_retries(texts).items():
            rows[i] = columns_of(line)
        assert len(rows) == len(requests), "every row gets its columns"
        table = batch.drop_columns([REQUEST_COLUMN])
        for name, kind in OUTPUT_COLUMNS.items():
            col = pa.array([rows[i][name] for i in range(len(requests))], type=kind)
            at = table.schema.get_field_index(name)
            table = table.set_column(at, name, col) if at >= 0 else table.append_column(name, col)
        return table
