"""The batch driver: validate, resume from the journal, fan rows out over engine replicas, finalize.

    validate whole file (refuse with every BatchError)  -> status "validating"
    journal: skip committed rows, refuse a reused custom_id with another body
    Ray Data: read_text -> pending rows -> map_batches(BatchReplica, concurrency=N) -> driver
    driver: journal each answered row (fsync) -> tqdm + status file    -> status "in_progress"
    rows whose replica died come back undone: another pass hands them out again
    output files written from the journal (each custom_id once)       -> "finalizing" -> "completed"

Exactly once: a row is done when, and only when, its journal line is fsync'd; the final files are
written from the journal alone, so a driver killed at any point and rerun neither loses nor repeats.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import EngineConfig
from cluster.metrics.ray_metrics import BatchMetrics
from cluster.metrics.stats import BatchProgress
from model_exec.source import resolve_model
from raytp.batch.input import BatchError, BatchRow, iter_rows, validate_file
from raytp.batch.journal import Journal
from raytp.batch.output import is_failure, write_final
from raytp.batch.status import BatchStatus, status_path_for
from raytp.openai.chat_settings import ChatSettings

logger = logging.getLogger(__name__)
MAX_PASSES = 3  # a pass redoes the rows whose replica died in the one before


class BatchRefused(ValueError):
    """The job did not start: the input file (or its journal) is invalid; `errors` names each line."""

    def __init__(self, message: str, errors: list[BatchError]) -> None:
        super().__init__(message)
        self.errors = errors


@dataclass(frozen=True)
class BatchJob:
    input_file: str
    output_file: str
    error_file: str | None
    engine: EngineConfig
    served_model_name: str | None = None
    chat: ChatSettings = field(default_factory=ChatSettings)  # tool-call and reasoning parsers, as the server's
    num_replicas: int = 1
    batch_size: int = 64  # rows per map_batches call: all of them are in the engine at once
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be at least 1.")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1.")

    @property
    def model_name(self) -> str:
        """The name rows must send as `model` (or omit): as the server names it."""
        return self.served_model_name or resolve_model(self.engine.model, self.engine.revision).name

    @property
    def journal_path(self) -> Path:
        p = Path(self.output_file)
        return p.with_name(p.name + ".journal")


def _pending(batch: dict[str, np.ndarray], done: frozenset[str]) -> dict[str, np.ndarray]:
    """Input lines not yet committed (line numbers are not needed: the file is already validated)."""
    texts = [str(t) for t in batch["text"] if str(t).strip()]
    keep = [t for t in texts if json.loads(t)["custom_id"] not in done]
    return {"line": np.zeros(len(keep), dtype=np.int64), "text": np.array(keep, dtype=object)}


def _check_journal(job: BatchJob, journal: Journal) -> list[BatchError]:
    errors = []
    for row in iter_rows(job.input_file):
        if isinstance(row, BatchRow) and journal.done.get(row.custom_id, row.body_hash) != row.body_hash:
            errors.append(
                BatchError(
                    "custom_id_reused",
                    f"custom_id {row.custom_id!r} was already answered for a different body; use a new id.",
                    "custom_id",
                    row.line,
                )
            )
    return errors


def _usage(line: dict[str, Any]) -> tuple[int, int]:
    usage = (line["response"]["body"] or {}).get("usage") or {}
    return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))


def _served_name_if_known(job: BatchJob) -> str | None:
    """The served model's name, or None when the model does not resolve (then the file is checked without it,
    and the job fails at the model's load, naming it)."""
    try:
        return job.model_name
    except Exception:
        return None


def validate_only(job: BatchJob) -> BatchStatus:
    """The whole file and its journal checked, no compute; raises BatchRefused listing each bad line."""
    status = BatchStatus(status_path_for(job.output_file), job.input_file, job.output_file, job.error_file)
    status.set("validating")
    checked = validate_file(job.input_file, _served_name_if_known(job))
    errors = checked.errors
    message = f"{checked.num_errors} invalid line(s) in {job.input_file}"
    if not errors and job.journal_path.exists():
        journal = Journal(job.journal_path)
        try:
            errors = _check_journal(job, journal)
        finally:
            journal.close()
        message = f"{len(errors)} reused custom_id(s) in {job.input_file}"
    if errors:
        status.errors = errors
        status.set("failed")
        raise BatchRefused(message, errors)
    status.total = checked.total
    return status


def run_batch(job: BatchJob) -> BatchStatus:
    """Run (or resume) the job to the end; raises BatchRefused before any model loads if the input is bad."""
    status = validate_only(job)
    journal = Journal(job.journal_path)
    # The job's progress gauges (raytp:batch_rows_*), labelled by the status file's batch id.
    metrics = BatchMetrics(job.model_name, status.id)
    try:
        _count_committed(journal, status)
        status.set("in_progress")
        for _ in range(MAX_PASSES):
            if len(journal.done) >= status.total:
                break
            _one_pass(job, journal, status, metrics)
        if len(journal.done) < status.total:
            status.set("failed")
            raise RuntimeError(
                f"{status.total - len(journal.done)} row(s) could not be answered (engine replicas lost); "
                "rerun the same command to finish them."
            )
        status.set("finalizing")
        status.completed, status.failed = write_final(journal, job.output_file, job.error_file)
        status.set("completed")
        _record(metrics, status)
        return status
    finally:
        metrics.close()
        journal.close()


def _count_committed(journal: Journal, status: BatchStatus) -> None:
    for line in journal.outputs():
        bad = is_failure(line)
        status.completed, status.failed = status.completed + (not bad), status.failed + bad
        p, c = _usage(line)
        status.prompt_tokens, status.completion_tokens = status.prompt_tokens + p, status.completion_tokens + c


def _record(metrics: BatchMetrics, status: BatchStatus) -> None:
    done = status.completed + status.failed
    metrics.record_progress(BatchProgress(rows_total=status.total, rows_done=done, rows_failed=status.failed))


def _one_pass(job: BatchJob, journal: Journal, status: BatchStatus, metrics: BatchMetrics) -> None:
    import ray
    from tqdm import tqdm

    from raytp.batch.replica import BatchReplica

    ds = ray.data.read_text(os.path.abspath(job.input_file))
    ds = ds.map_batches(functools.partial(_pending, done=frozenset(journal.done)), batch_format="numpy")
    ds = ds.map_batches(
        BatchReplica,
        fn_constructor_kwargs={
            "engine_config": job.engine,
            "served_model_name": job.served_model_name,
            "chat": job.chat,
        },
        concurrency=job.num_replicas,
        batch_size=job.batch_size,
        num_cpus=0,  # the replica only relays; its controller and workers hold the resources
        batch_format="numpy",
    )
    bar = tqdm(
        total=status.total, initial=len(journal.done), unit="row", disable=not job.show_progress, file=sys.stderr
    )
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            records = []
            cols = (batch["custom_id"], batch["hash"], batch["output"], batch["done"])
            for cid, h, out, done in zip(*cols, strict=True):
                if not done or str(cid) in journal.done:
                    continue
                line = json.loads(str(out))
                records.append((str(cid), str(h), line))
                bad = is_failure(line)
                status.completed, status.failed = status.completed + (not bad), status.failed + bad
                p, c = _usage(line)
                status.prompt_tokens, status.completion_tokens = status.prompt_tokens + p, status.completion_tokens + c
            journal.append(records)
            bar.update(len(records))
            bar.set_postfix(tokens=status.completion_tokens, refresh=False)
            status.write()
            _record(metrics, status)
    finally:
        bar.close()
