"""OpenAI's BatchRequestOutput lines, and the final files written from the journal.

Success: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}`.
A request the server would refuse: the same shape with the HTTP status and the error body, as
OpenAI's batch output reports per-request failures. With an error file, rows whose status is not
200 go there (OpenAI's split); without one, every row goes to the output file (vLLM's habit).
Final files are written to a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from raytp.batch.journal import Journal


def output_line(custom_id: str, request_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    error = None
    if status_code != 200:
        err = body.get("error", {})
        error = {"code": err.get("code"), "message": err.get("message")}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": error,
    }


def is_failure(line: dict[str, Any]) -> bool:
    return int(line["response"]["status_code"]) != 200


def write_final(journal: Journal, output: str | Path, error_file: str | Path | None) -> tuple[int, int]:
    """(completed, failed) counts; each custom_id appears exactly once across the files."""
    paths = [Path(output)] + ([Path(error_file)] if error_file else [])
    tmps = [p.with_name(p.name + ".tmp") for p in paths]
    completed = failed = 0
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(t, "w", encoding="utf-8")) for t in tmps]
        for line in journal.outputs():
            bad = is_failure(line)
            completed, failed = completed + (not bad), failed + bad
            f = files[1] if bad and error_file else files[0]
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
        for f in files:
            f.flush()
            os.fsync(f.fileno())
    for t, p in zip(tmps, paths, strict=True):
        os.replace(t, p)
    return completed, failed
