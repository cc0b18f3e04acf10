"""The append-only journal: the only record of which rows are done, and their answers.

One JSON line per committed row: `{"custom_id", "hash", "output"}`, written and fsync'd before the
row counts as done. Invariants:
- a custom_id appears at most once (the driver appends only ids not already in the index);
- a torn last line (the driver killed mid-write) is cut off on open, so that row is simply redone;
- a rerun whose row has the same custom_id but a different body hash is refused (the id was reused).
The index kept in memory is custom_id -> hash only; answers stay on disk until the final files are written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.done: dict[str, str] = {}  # custom_id -> body hash of every committed row
        self._recover()
        self._f = open(self.path, "ab")  # noqa: SIM115  # held for the job, closed by close()

    def _recover(self) -> None:
        if not self.path.exists():
            return
        good = 0  # byte length of the prefix of whole, parseable lines
        with open(self.path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                try:
                    rec = json.loads(raw)
                except json.JSONDecodeError:
                    break
                self.done[rec["custom_id"]] = rec["hash"]
                good += len(raw)
        if good != self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def append(self, records: list[tuple[str, str, dict[str, Any]]]) -> None:
        """Commit (custom_id, hash, output line) records: written, then fsync'd, then counted done."""
        fresh = [r for r in records if r[0] not in self.done]
        if not fresh:
            return
        data = b"".join(
            json.dumps({"custom_id": c, "hash": h, "output": o}, ensure_ascii=False).encode() + b"\n"
            for c, h, o in fresh
        )
        self._f.write(data)
        self._f.flush()
        os.fsync(self._f.fileno())
        for c, h, _ in fresh:
            self.done[c] = h

    def outputs(self) -> Iterator[dict[str, Any]]:
        self._f.flush()
        with open(self.path, encoding="utf-8") as f:
            for raw in f:
                yield json.loads(raw)["output"]

    def close(self) -> None:
        self._f.close()
