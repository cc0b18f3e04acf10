"""benchmarks/common/vllm_bench_client.py: our length ranges as vLLM's random dataset, its result as our keys."""

from __future__ import annotations

import json

import pytest

from benchmarks.common import vllm_bench_client as client


def test_length_ranges_become_centre_and_ratio() -> None:
    assert client.centre_and_ratio(128, 384) == (256, 0.5)  # the 256 +- 50%
    assert client.centre_and_ratio(64, 64) == (64, 0.0)
    with pytest.raises(ValueError, match="MIN <= MAX"):
        client.centre_and_ratio(10, 5)


_VALUED = ("--dataset-name", "--num-prompts", "--request-rate", "--seed")


def test_command_carries_the_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "vllm_python", lambda: "/venv/bin/python")
    cmd = client.bench_serve_command(
        "http://127.0.0.1:8000", "m", "/tok", (128, 384), (64, 64), 64, 2.0, 7, "/out", "r.json"
    )
    args = {flag: cmd[cmd.index(flag) + 1] for flag in cmd if flag.startswith("--random") or flag in _VALUED}
    assert cmd[:2] == ["/venv/bin/python", "-c"]
    assert args["--dataset-name"] == "random"
    assert (args["--random-input-len"], args["--random-output-len"]) == ("256", "64")
    assert json.loads(args["--random-range-ratio"]) == {"input": 0.5, "output": 0.0}
    assert (args["--num-prompts"], args["--request-rate"], args["--seed"]) == ("64", "2.0", "7")
    assert "--ignore-eos" in cmd and "--save-result" in cmd


def test_result_maps_to_summary_keys() -> None:
    result = {
        "completed": 63,
        "failed": 1,
        "duration": 40.0,
        "request_throughput": 1.5,
        "output_throughput": 96.0,
        "total_token_throughput": 480.0,
        "total_output_tokens": 4032,
        "errors": ["", "boom"],
    }
    for i, m in enumerate(("ttft", "itl", "tpot", "e2el")):
        result |= {f"mean_{m}_ms": 10.0 + i, f"median_{m}_ms": 20.0 + i, f"p99_{m}_ms": 30.0 + i}
    s = client.summary_of(result, 2.0)
    assert (s["ttft_p50_ms"], s["itl_p50_ms"], s["tpot_p99_ms"], s["e2e_latency_mean_ms"]) == (20.0, 21.0, 32.0, 13.0)
    assert (s["completed"], s["failed"], s["offered_rate"], s["errors"]) == (63, 1, 2.0, ["boom"])
