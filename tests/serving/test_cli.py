"""`raytp serve`'s command line without a server: what it refuses before starting Ray, and the cores it claims.

A started `raytp serve` (its banner, RAYTP_API_KEY, a completion, and a clean stop on Ctrl-C and on
SIGTERM) is tests/serving/test_serve_lifecycle.py's: one server start there proves all of it, where this
module once started two more servers (one per signal) to prove the same.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raytp.cli.main import main


def test_raytp_serve_refuses_a_bad_model_before_starting_ray(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "/no/such/model"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["serve", "--tensor-parallel-size", "2"]) == 2  # SmolLM2's 9 heads do not split in 2
    assert "tensor_parallel_size=2 must divide" in capsys.readouterr().err


def test_raytp_serve_refuses_a_bad_adapter_or_config_before_starting_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import ray

    assert main(["serve", "--enable-lora", "--lora-modules", "sql=/no/such/adapter"]) == 2
    err = capsys.readouterr().err
    assert "'sql'" in err and "/no/such/adapter" in err
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - {model: /no/such/model, served_model_name: a}\n  - {served_model_name: b}\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "not found" in capsys.readouterr().err
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ({}, None, "8"),  # TP=1, one replica: every core
        ({"tensor_parallel_size": 2, "num_replicas": 2}, None, "2"),
        ({"tensor_parallel_size": 3}, None, "2"),  # 8 // 3, whole CPUs
        ({"num_replicas": 16}, None, "1"),  # never below one CPU
        ({}, "3", "3"),  # the user's RAYTP_CPUS_PER_WORKER wins
        ({"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}, None, None),  # count unknown
    ],
)
def test_a_local_serve_splits_the_cores_among_its_ranks(
    monkeypatch: pytest.MonkeyPatch, args: dict[str, object], env: str | None, expected: str | None
) -> None:
    from raytp.cli.serve import _claim_the_machines_cores
    from raytp.serve.args import ServeArgs

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    # A private environment: the function writes os.environ, and a leaked value would make every
    # later test's Ray workers ask for 8 CPUs.
    environ = {k: v for k, v in os.environ.items() if k != "RAYTP_CPUS_PER_WORKER"}
    if env is not None:
        environ["RAYTP_CPUS_PER_WORKER"] = env
    monkeypatch.setattr(os, "environ", environ)
    _claim_the_machines_cores(ServeArgs.from_dict(args))
    assert environ.get("RAYTP_CPUS_PER_WORKER") == expected
