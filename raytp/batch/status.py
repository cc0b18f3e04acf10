"""The job's status file: an OpenAI Batch object, rewritten atomically as the job runs.

status: validating -> in_progress -> finalizing -> completed, or failed (with `errors`).
Another process may read it at any time (write to a temporary file, then rename).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytp.batch.input import BatchError


def status_path_for(output: str | Path) -> Path:
    p = Path(output)
    return p.with_name(p.name + ".status.json")


@dataclass
class BatchStatus:
    path: Path
    input_file: str
    output_file: str
    error_file: str | None
    id: str = field(default_factory=lambda: f"batch_{uuid.uuid4().hex}")
    status: str = "validating"
    created_at: int = field(default_factory=lambda: int(time.time()))
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: list[BatchError] = field(default_factory=list)
    stamps: dict[str, int] = field(default_factory=dict)  # in_progress_at, finalizing_at, completed_at, failed_at

    def set(self, status: str) -> None:
        self.status = status
        if status != "validating":
            self.stamps[f"{status}_at"] = int(time.time())
        self.write()

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": None,
            "errors": {"object": "list", "data": [e.to_dict() for e in self.errors]} if self.errors else None,
            "input_file_id": self.input_file,
            "completion_window": "24h",
            "status": self.status,
            "output_file_id": self.output_file,
            "error_file_id": self.error_file,
            "created_at": self.created_at,
            **{k: self.stamps.get(k) for k in ("in_progress_at", "finalizing_at", "completed_at", "failed_at")},
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            },
        }

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(tmp, self.path)
