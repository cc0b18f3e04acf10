"""`raytp serve` as a user runs it: one command starts Ray, deploys, prints its URL, serves, and
stops cleanly on Ctrl-C (SIGINT) or SIGTERM. A tiny model keeps it quick; the API key comes
from RAYTP_API_KEY.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from raytp.cli.main import main
from tests.helpers.tiny_models import make_tiny_llama
from tests.serving.live_server import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _lines(stream: object, out: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        out.put(line)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_raytp_serve_starts_serves_and_stops(model_dir: str, sig: signal.Signals) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAYTP_API_KEY"] = "cli-key"
    cmd = [sys.executable, "-m", "raytp.cli.main", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 22), "--swap-space", "0.01"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("raytp: serving" in line for line in seen):
            assert proc.poll() is None, "raytp serve exited early:\n" + "".join(seen[-40:])
            assert time.monotonic() < deadline, "raytp serve did not come up:\n" + "".join(seen[-40:])
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        banner = next(line for line in seen if "raytp: serving" in line)
        assert f"http://127.0.0.1:{port}/v1" in banner
        base = f"http://127.0.0.1:{port}"
        assert requests.get(base + "/v1/models", timeout=30).status_code == 401
        auth = {"Authorization": "Bearer cli-key"}
        models = requests.get(base + "/v1/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == [model_dir]
        r = requests.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(sig)
        assert proc.wait(timeout=90) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(base + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
