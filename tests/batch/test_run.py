"""Batch jobs on real Ray with a tiny random-weight model: every row answered once, resumable.

One local Ray per module (8 logical CPUs: each engine replica's worker holds a 1-CPU bundle, and
Ray Data's read tasks take CPUs of their own).
The reference is an uninterrupted 1-replica run; greedy and seeded rows make every rerun's bodies
equal to it, so "nothing lost or doubled" is checked body by body. It is also the finished job whose
rows, failures and rerun the first two tests check (each once ran a batch of its own for that).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray

from raytp.batch.replica import CONTROLLER_PREFIX
from raytp.batch.runner import BatchJob, run_batch
from raytp.batch.status import BatchStatus
from tests.batch.helpers import BAD_IDS, ENGINE, MODEL_NAME, by_id, engine_config, mixed_rows, read_lines, write_rows

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def job(tmp: Path, model_dir: str, src: Path, replicas: int = 1, batch_size: int = 4) -> BatchJob:
    return BatchJob(
        str(src), str(tmp / "out.jsonl"), str(tmp / "err.jsonl"), engine_config(model_dir), MODEL_NAME,
        num_replicas=replicas, batch_size=batch_size, show_progress=False,
    )  # fmt: skip


@dataclass
class Reference:
    """The uninterrupted run of the long file (1 replica): its directory, input rows, status and answers."""

    dir: Path
    src: Path
    rows: list[dict[str, Any]]
    status: BatchStatus
    got: dict[str, Any]  # custom_id -> (status, body)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, model_dir: str, cluster: str) -> Reference:
    """One finished job that every test of this module reads (each test once ran its own): a test may rerun
    it, which must change nothing, but NOT write into its directory otherwise."""
    tmp = tmp_path_factory.mktemp("reference")
    rows = mixed_rows(num_plain=24, max_tokens=24)
    src = write_rows(tmp / "in.jsonl", rows)
    status = run_batch(job(tmp, model_dir, src))
    assert status.status == "completed"
    return Reference(tmp, src, rows, status, by_id(read_lines(tmp / "out.jsonl", tmp / "err.jsonl")))


def test_every_row_answered_once_and_failures_split(reference: Reference) -> None:
    tmp_path, rows, status = reference.dir, reference.rows, reference.status
    ok, failed = read_lines(tmp_path / "out.jsonl"), read_lines(tmp_path / "err.jsonl")
    assert {x["custom_id"] for x in failed} == BAD_IDS
    got = by_id(ok + failed)
    assert set(got) == {r["custom_id"] for r in rows}
    assert all(s == 200 for s, _ in (got[x["custom_id"]] for x in ok))
    assert {got[i][1]["error"]["param"] for i in BAD_IDS} == {"temperature", "stream", "prompt", "messages"}
    assert {got[i][0] for i in BAD_IDS} == {400}
    assert len(got["n2"][1]["choices"]) == 2 and len(got["chat-n2"][1]["choices"]) == 2
    assert got["logprobs"][1]["choices"][0]["logprobs"]["top_logprobs"][0]
    assert got["chat"][1]["object"] == "chat.completion" and got["chat"][1]["model"] == MODEL_NAME
    assert all(x["error"] is None for x in ok) and all(x["error"]["message"] for x in failed)
    assert (status.status, status.completed, status.failed, status.total) == ("completed", 29, 4, 33)
    assert status.completion_tokens > 0


def test_a_rerun_of_a_finished_job_changes_nothing(reference: Reference, model_dir: str, cluster: str) -> None:
    tmp_path = reference.dir
    first = (tmp_path / "out.jsonl").read_text(), (tmp_path / "err.jsonl").read_text()
    run_batch(job(tmp_path, model_dir, reference.src))
    assert ((tmp_path / "out.jsonl").read_text(), (tmp_path / "err.jsonl").read_text()) == first


def _journal_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_driver_kill9_then_rerun_equals_an_uninterrupted_run(
    tmp_path: Path, model_dir: str, cluster: str, reference: Reference
) -> None:
    src = write_rows(tmp_path / "in.jsonl", mixed_rows(num_plain=24, max_tokens=24))
    engine_flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    cmd = [str(BIN / "raytp"), "batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl")]
    cmd += ["--error-file", str(tmp_path / "err.jsonl"), model_dir, "--served-model-name", MODEL_NAME]
    cmd += ["--max-concurrency", "2", *engine_flags]
    env = {**os.environ, "RAY_ADDRESS": cluster}
    journal = tmp_path / "out.jsonl.journal"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while _journal_lines(journal) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = _journal_lines(journal)
    assert 3 <= committed < len(reference.got), committed
    assert not (tmp_path / "out.jsonl").exists()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=400)
    assert by_id(read_lines(tmp_path / "out.jsonl", tmp_path / "err.jsonl")) == reference.got


def test_an_engine_replica_killed_mid_job_loses_and_doubles_nothing(
    tmp_path: Path, model_dir: str, cluster: str, reference: Reference
) -> None:
    src = write_rows(tmp_path / "in.jsonl", mixed_rows(num_plain=24, max_tokens=24))
    journal = tmp_path / "out.jsonl.journal"
    killed: list[str] = []

    def kill_one_engine() -> None:
        deadline = time.monotonic() + 240
        while _journal_lines(journal) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        engines = [
            a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(CONTROLLER_PREFIX)
        ]
        if engines:
            ray.kill(ray.get_actor(engines[0]["name"], namespace=engines[0]["namespace"]), no_restart=True)
            killed.append(engines[0]["name"])

    killer = threading.Thread(target=kill_one_engine)
    killer.start()
    status = run_batch(job(tmp_path, model_dir, src, replicas=2, batch_size=2))
    killer.join()
    assert killed, "no engine replica was alive to kill"
    assert _journal_lines(journal) == len(reference.got)
    assert status.status == "completed"
    assert by_id(read_lines(tmp_path / "out.jsonl", tmp_path / "err.jsonl")) == reference.got
