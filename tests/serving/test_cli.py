"""`raytp serve`'s command line without a server: what it refuses before starting Ray, and the cores it claims.

A started `raytp serve` (its banner, RAYTP_API_KEY, a completion, and a clean stop on Ctrl-C and on
SIGTERM) is tests/serving/test_serve_lifecycle.py's: one server start there proves all of it, where this
module once started two more servers (one per signal) to prove the same.
"""

from __future__ import annotations

import json
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


_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_speculative_config_is_a_flag_of_serve_and_batch() -> None:
    """`--speculative-config` JSON (vLLM's flag) reaches the engine of `raytp serve` and of `raytp batch`."""
    from raytp.cli.args import engine_config_from_args
    from raytp.cli.main import build_parser
    from raytp.cli.serve import serve_args_of
    from raytp.serve.args import ServeArgs

    flag = ["--speculative-config", json.dumps(_NGRAM)]
    serve = build_parser().parse_args(["serve", *flag])
    engine = ServeArgs.from_dict(serve_args_of(serve)).model.engine
    assert engine.speculative_config == _NGRAM
    assert engine.speculative is not None and engine.speculative.num_speculative_tokens == 4
    batch = build_parser().parse_args(["batch", "-i", "in.jsonl", "-o", "out.jsonl", *flag])
    assert engine_config_from_args(batch).speculative_config == _NGRAM


@pytest.mark.parametrize("command", [["serve"], ["batch", "-i", "in.jsonl", "-o", "out.jsonl"]])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{method: ngram}", "--speculative-config: not valid JSON"),
        ("4", "--speculative-config: expected a JSON object, got int"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model, got 'eagle'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be at least 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 3}', "unknown key(s) k"),
    ],
)
def test_a_bad_speculative_config_exits_2_naming_it_before_starting_ray(
    capsys: pytest.CaptureFixture[str], command: list[str], value: str, message: str
) -> None:
    import ray

    try:
        rc = main([*command, "--speculative-config", value])
    except SystemExit as e:  # argparse's usage error, as for any malformed flag
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not ray.is_initialized()


def test_serve_with_a_draft_model_it_cannot_read_exits_2_before_starting_ray(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import ray

    draft = '{"method": "draft_model", "model": "/nowhere/draft", "num_speculative_tokens": 2}'
    assert main(["serve", "--speculative-config", draft]) == 2
    assert "speculative_config: the draft model cannot be read" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_speculative_config_with_async_scheduling_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--async-scheduling", "--speculative-config", json.dumps(_NGRAM)]) == 2
    assert "speculative_config needs async_scheduling off" in capsys.readouterr().err
