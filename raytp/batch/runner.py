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
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import EngineConfig
from cluster.metrics.ray_metrics import BatchMetrics
from cluster.metrics.stats import BatchProgress
from model_exec.source import resolve_model
from raytp.batch.input import BatchError, BatchRow, iter_rows, model_of, rows_by_model, validate_file
from raytp.batch.journal import Journal
from raytp.batch.output import is_failure, write_final
from raytp.batch.status import BatchStatus, status_path_for
from raytp.openai.chat_settings import ChatSettings
from raytp.serve.args import LoRAModule
from request.lora import LoRARequest

logger = logging.getLogger(__name__)
MAX_PASSES = 3  # a pass redoes the rows whose replica died in the one before


class BatchRefused(ValueError):
    """The job did not start: the input file (or its journal) is invalid; `errors` names each line."""

    def __init__(self, message: str, errors: list[BatchError]) -> None:
        super().__init__(message)
        self.errors = errors


@dataclass(frozen=True)
class BatchModel:
    """One model a batch job serves: its engine, the name rows send as `model`, and its engine replicas."""

    engine: EngineConfig
    served_model_name: str | None = None
    num_replicas: int = 1
    # adapters rows may name as `model` (`--lora-modules`); the job numbers them 1..n over all its models
    lora_modules: tuple[LoRAModule, ...] = ()

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be at least 1.")
        if self.lora_modules and not self.engine.enable_lora:
            names = ", ".join(m.name for m in self.lora_modules)
            raise ValueError(f"lora_modules ({names}) need enable_lora (--enable-lora).")

    @property
    def model_name(self) -> str:
        """The name rows send as `model`: as the server names it."""
        return self.served_model_name or resolve_model(self.engine.model, self.engine.revision).name


@dataclass(frozen=True)
class BatchJob:
    """A batch file over one model (`engine`, `served_model_name`, `num_replicas`) or, with `more_models`,
    several: each row names its model in `body.model` (a row may omit it only when the job serves one)."""

    input_file: str
    output_file: str
    error_file: str | None
    engine: EngineConfig
    served_model_name: str | None = None
    chat: ChatSettings = field(default_factory=ChatSettings)  # tool-call and reasoning parsers, as the server's
    num_replicas: int = 1
    batch_size: int = 64  # rows per map_batches call: all of them are in the engine at once
    show_progress: bool = True
    more_models: tuple[BatchModel, ...] = ()
    lora_modules: tuple[LoRAModule, ...] = ()  # the first model's adapters (each of more_models has its own)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be at least 1.")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1.")

    @property
    def models(self) -> tuple[BatchModel, ...]:
        first = BatchModel(self.engine, self.served_model_name, self.num_replicas, self.lora_modules)
        return (first, *self.more_models)

    @property
    def model_name(self) -> str:
        """The first model's name: the one rows that name no model go to."""
        return self.models[0].model_name

    @property
    def model_names(self) -> list[str]:
        """Every name rows may send as `model`: each model's, then its adapters'; a name taken twice is refused."""
        names = [m.model_name for m in self.models] + [a.name for m in self.models for a in m.lora_modules]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two models or adapters of this job are served as {', '.join(twice)}.")
        return names

    def adapters(self) -> list[tuple[BatchModel, LoRARequest]]:
        """Every adapter with its base model, numbered 1..n in the order the models list them (as `raytp serve`
        numbers --lora-modules)."""
        pairs = [(m, a) for m in self.models for a in m.lora_modules]
        return [(m, LoRARequest(a.name, i, a.path)) for i, (m, a) in enumerate(pairs, start=1)]

    @property
    def journal_path(self) -> Path:
        p = Path(self.output_file)
        return p.with_name(p.name + ".journal")


def _pending(
    batch: dict[str, np.ndarray], done: frozenset[str], names: frozenset[str], default: str
) -> dict[str, np.ndarray]:
    """Input lines for one model (`names`: the model's and its adapters') not yet committed (line numbers are not
    needed: the file is already validated). A line naming no model belongs to `default`."""
    rows = [json.loads(str(t)) for t in batch["text"] if str(t).strip()]
    keep = [
        json.dumps(r, ensure_ascii=False)
        for r in rows
        if r["custom_id"] not in done and model_of(r["body"], default) in names
    ]
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


def _served_names_if_known(job: BatchJob) -> list[str] | None:
    """The served models' names, or None when a model does not resolve (then the file is checked without them,
    and the job fails at that model's load, naming it)."""
    try:
        return job.model_names
    except Exception:
        if job.more_models:  # several models: rows cannot be checked without their names
            raise
        return None


def validate_only(job: BatchJob) -> BatchStatus:
    """The whole file and its journal checked, no compute; raises BatchRefused listing each bad line."""
    status = BatchStatus(status_path_for(job.output_file), job.input_file, job.output_file, job.error_file)
    status.set("validating")
    checked = validate_file(job.input_file, _served_names_if_known(job))
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
    metrics = BatchMetrics(",".join(job.model_names), status.id)
    try:
        _count_committed(journal, status)
        status.set("in_progress")
        rows_of = rows_by_model(job.input_file, job.model_name)
        # One model at a time, in the job's order: the cluster holds one model's engines at once.
        for model in job.models:
            loras = [lora for m, lora in job.adapters() if m == model]
            names = frozenset([model.model_name, *(lora.lora_name for lora in loras)])
            ids = set().union(*(rows_of.get(n, set()) for n in names))
            for _ in range(MAX_PASSES):
                if ids <= journal.done.keys():
                    break
                _one_pass(job, model, loras, names, journal, status, metrics)
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


def _one_pass(
    job: BatchJob,
    model: BatchModel,
    loras: list[LoRARequest],
    names: frozenset[str],
    journal: Journal,
    status: BatchStatus,
    metrics: BatchMetrics,
) -> None:
    """One pass over the rows of `model` (`names`: it and its adapters) not yet journalled, through its own
    engine replicas, whose placement groups are freed when it ends (however it ends)."""
    import ray
    from tqdm import tqdm

    from cluster.placement import remove_groups_named
    from raytp.batch.replica import BatchReplica

    group_prefix = f"raytp-batch-{uuid.uuid4().hex[:8]}-"  # this pass's engines' groups, and no one else's

    ds = ray.data.read_text(os.path.abspath(job.input_file))
    pending = functools.partial(_pending, done=frozenset(journal.done), names=names, default=job.model_name)
    ds = ds.map_batches(pending, batch_format="numpy")
    ds = ds.map_batches(
        BatchReplica,
        fn_constructor_kwargs={
            "engine_config": model.engine,
            "served_model_name": model.model_name,
            "chat": job.chat,
            "loras": loras,
            "group_prefix": group_prefix,
        },
        concurrency=model.num_replicas,
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
        freed = remove_groups_named(group_prefix)
        logger.debug("pass over %s: freed its engines' placement groups %s", model.model_name, freed)
