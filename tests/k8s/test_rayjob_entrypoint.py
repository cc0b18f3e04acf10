"""The RayJob's entrypoint is a `raytp batch` command line that works as written.

- Its engine flags are the ones raytp's CLI defines, spelt its way, and mean the values' engine.
- Against a local `ray start --head` cluster, `ray job submit -- <entrypoint>` (what KubeRay's
  submitter runs) with only the claim mount paths replaced answers every row of a batch file on a
  tiny random-weight model.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.config import EngineConfig
from raytp.cli.args import engine_config_from_args
from tests.helpers.ray_cluster import local_ray_cluster
from tests.k8s.chart import load_values, merged_values, one, render

BIN = Path(sys.executable).parent
DATA_MOUNT, MODEL_MOUNT = "/data", "/models"


def _entrypoint(values: dict[str, Any]) -> list[str]:
    words = shlex.split(one(render(values), "RayJob")["spec"]["entrypoint"])
    assert words[:2] == ["raytp", "batch"], words
    return words


def _batch_parser() -> argparse.ArgumentParser:
    """`raytp batch`'s own parser (with its engine flags), as the CLI builds it."""
    from raytp.cli.main import build_parser

    return build_parser()


@pytest.mark.parametrize("setup", ["batch", "cpu-small", "gpu-tp2"])
def test_entrypoint_flags_are_raytps_engine_flags(setup: str) -> None:
    values = load_values(setup)
    values.setdefault("batch", {}).update({"enabled": True, "data": {"claimName": "batch-data"}})
    merged = merged_values(values)
    words = _entrypoint(values)
    args = _batch_parser().parse_args(words[1:])  # a misspelt or unknown flag exits here

    model = {"embedded": None, "pvc": f"{MODEL_MOUNT}/{merged['model']['pvc']['path']}"}.get(
        merged["model"]["source"], merged["model"]["huggingface"]["id"]
    )
    assert engine_config_from_args(args) == EngineConfig(model=model, **merged["engine"])
    assert args.num_replicas == merged["batch"]["numReplicas"]
    assert (
        args.input_file == f"{DATA_MOUNT}/{merged['batch']['input']}"
        and args.output_file == f"{DATA_MOUNT}/{merged['batch']['output']}"
    )


def test_entrypoint_quotes_what_the_shell_would_split() -> None:
    values = {
        "batch": {"enabled": True, "data": {"claimName": "d"}, "input": "my jobs/in.jsonl", "extraArgs": ["--x", "a b"]}
    }
    words = _entrypoint(values)
    assert words[words.index("-i") + 1] == "/data/my jobs/in.jsonl"
    assert words[-2:] == ["--x", "a b"]


# ---- the entrypoint run as written on a local Ray cluster ---------------------------------------------


def _rows() -> list[dict[str, Any]]:
    completion = {"max_tokens": 4, "temperature": 0.0}  # no "model": the entrypoint names no served name
    return [
        {"custom_id": "c-1", "method": "POST", "url": "/v1/completions", "body": {**completion, "prompt": "hello"}},
        {
            "custom_id": "c-2",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**completion, "prompt": "abc", "n": 2, "temperature": 0.8, "seed": 3},  # n > 1 samples
        },
        {
            "custom_id": "chat-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**completion, "messages": [{"role": "user", "content": "hi"}]},
        },
        {
            "custom_id": "logprobs",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**completion, "prompt": "xyz", "logprobs": 2},
        },
        {
            "custom_id": "stop",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**completion, "prompt": "pqr", "max_tokens": 12, "stop": ["a", "e"]},
        },
        # Well-formed but longer than max_model_len: an error line, and the job goes on.
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**completion, "prompt": "x" * 400},
        },
    ]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_entrypoint_runs_as_written_on_a_local_ray_cluster(tmp_path: Path) -> None:
    from tests.helpers.tiny_models import make_tiny_llama

    models, data = tmp_path / "models", tmp_path / "data"
    make_tiny_llama(models)  # -> models/tiny-llama
    (data / "jobs").mkdir(parents=True)
    (data / "jobs" / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    values = load_values("batch")
    values["model"] = {"source": "pvc", "pvc": {"claimName": "models", "path": "tiny-llama"}}
    values["engine"] = {
        "tensor_parallel_size": 1, "device": "cpu", "dtype": "float32",
        "max_model_len": 256, "max_num_seqs": 8, "kv_cache_memory_bytes": 16 << 20,
    }  # fmt: skip
    values["batch"].update(
        {"input": "jobs/in.jsonl", "output": "jobs/out.jsonl", "errorFile": "jobs/err.jsonl", "numReplicas": 1}
    )
    # The same command line with only the claims' mount paths moved to where they are here.
    mounts = {DATA_MOUNT: str(data), MODEL_MOUNT: str(models)}
    words = [
        next((local + w[len(m) :] for m, local in mounts.items() if w.startswith(m + "/")), w)
        for w in _entrypoint(values)
    ]
    # Token auth off explicitly: whether `ray start` turns it on depends on a token file in $HOME.
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    with local_ray_cluster(env, tmp_path / "ray-start.log") as address:
        proc = subprocess.run(
            # As KubeRay's submitter: its shell splits the entrypoint into words, and Ray quotes each again.
            [str(BIN / "ray"), "job", "submit", "--address", address, "--", *words],
            env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    out, err = _read_jsonl(data / "jobs" / "out.jsonl"), _read_jsonl(data / "jobs" / "err.jsonl")
    ids = sorted(r["custom_id"] for r in out + err)
    assert ids == sorted(r["custom_id"] for r in _rows()), ids  # each row answered exactly once
    assert {r["custom_id"] for r in err} == {"too-long"}
    for record in out:
        assert record["error"] is None and record["response"]["status_code"] == 200, record
        assert record["response"]["body"]["choices"], record
    logprobs = next(r for r in out if r["custom_id"] == "logprobs")["response"]["body"]["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] and logprobs["tokens"], logprobs
