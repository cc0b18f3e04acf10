"""Reading an OpenAI batch file line by line, and validating all of it before any compute.

A line is `{"custom_id", "method": "POST", "url", "body"}`, where `url` is any route of the server's route
table (raytp/openai/routes.py). Structural faults (broken JSON, a missing or mistyped field, an unknown
url, a duplicate `custom_id`) refuse the whole job, each reported as
OpenAI's `BatchError{code, message, param, line}` with its 1-based line number. The body's own fields
are *not* checked here: they are validated by the HTTP server's request models at run time, so a bad
body becomes that row's error line (the 400 the server would answer) and the job goes on.

Memory: lines are streamed; only the set of `custom_id`s seen is kept (to find duplicates).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytp.openai.routes import ROUTES_BY_PATH

MAX_LISTED_ERRORS = 1000  # a refused file lists at most this many errors (the count is exact)


@dataclass(frozen=True)
class BatchError:
    """OpenAI's BatchError: why one input line was refused."""

    code: str
    message: str
    param: str | None
    line: int

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True)
class BatchRow:
    line: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict[str, Any]
    body_hash: str  # sha256 of the canonical body JSON and url: a reused custom_id must carry the same


def body_hash(url: str, body: dict[str, Any]) -> str:
    canon = json.dumps({"url": url, "body": body}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def parse_line(line_no: int, text: str) -> BatchRow | BatchError:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchError("invalid_json_line", f"This line is not valid JSON: {e.msg}.", None, line_no)
    if not isinstance(obj, dict):
        return BatchError("invalid_request", "Each line must be a JSON object.", None, line_no)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchError("missing_required_parameter", "custom_id must be a non-empty string.", "custom_id", line_no)
    url = obj.get("url")
    route = ROUTES_BY_PATH.get(url) if isinstance(url, str) else None
    if route is None:
        urls = ", ".join(ROUTES_BY_PATH)
        return BatchError("invalid_url", f"url must be one of {urls}; got {url!r}.", "url", line_no)
    if obj.get("method") != route.method:
        return BatchError("invalid_method", f"method must be {route.method}.", "method", line_no)
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchError("missing_required_parameter", "body must be a JSON object.", "body", line_no)
    return BatchRow(line_no, cid, str(url), body, body_hash(str(url), body))


def iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line, streamed."""
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, start=1):
            if raw.strip():
                yield n, raw


def iter_rows(path: str | Path) -> Iterator[BatchRow | BatchError]:
    for n, text in iter_lines(path):
        yield parse_line(n, text)


@dataclass(frozen=True)
class Validation:
    total: int  # well-formed rows
    errors: list[BatchError]  # at most MAX_LISTED_ERRORS of them
    num_errors: int


def model_of(body: dict[str, Any], default: str) -> str:
    """The model a row runs on: its `model`, or the job's first model when it names none."""
    model = body.get("model")
    return model if isinstance(model, str) and model else default


def rows_by_model(path: str | Path, default: str) -> dict[str, set[str]]:
    """The custom_ids of each model's rows (a validated file), streamed."""
    rows: dict[str, set[str]] = {}
    for item in iter_rows(path):
        if isinstance(item, BatchRow):
            rows.setdefault(model_of(item.body, default), set()).add(item.custom_id)
    return rows


def _model_error(body: dict[str, Any], served: Sequence[str] | None, line: int) -> BatchError | None:
    """A row naming a model the job does not serve (the server would answer 404), or naming none when the job
    serves several."""
    if not served:
        return None
    model = body.get("model")
    if len(served) > 1 and not (isinstance(model, str) and model):
        return BatchError(
            "missing_required_parameter",
            f"This job serves several models ({', '.join(served)}): each row must name one as `model`.",
            "body.model",
            line,
        )
    if isinstance(model, str) and model and model not in served:
        return BatchError(
            "model_not_found",
            f"The model `{model}` is not served by this job; it serves {', '.join(f'`{s}`' for s in served)}.",
            "body.model",
            line,
        )
    return None


def validate_file(path: str | Path, served_models: Sequence[str] | None = None) -> Validation:
    """Every structural fault of the file (one pass, streamed). With `served_models`, a row that names another
    model is refused too: the server would answer it 404, so the job would run only to fail it."""
    seen: set[str] = set()
    errors: list[BatchError] = []
    total = num_errors = 0
    for item in iter_rows(path):
        if isinstance(item, BatchRow) and item.custom_id in seen:
            item = BatchError(
                "duplicate_custom_id", f"custom_id {item.custom_id!r} appears more than once.", "custom_id", item.line
            )
        elif isinstance(item, BatchRow) and (bad := _model_error(item.body, served_models, item.line)):
            item = bad
        if isinstance(item, BatchError):
            num_errors += 1
            if len(errors) < MAX_LISTED_ERRORS:
                errors.append(item)
            continue
        seen.add(item.custom_id)
        total += 1
    return Validation(total, errors, num_errors)
