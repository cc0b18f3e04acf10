"""benchmarks/gpu_check.py on a machine without a GPU: it runs, on the bare box's packages only, up to its
first CUDA call and stops there saying so, with its log written; its pure helpers are checked here too."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_check import LLAMA3_8B, check_logprobs_close, roofline
from tests.helpers.bare_python import run_bare

_RUN = """
import runpy
sys.argv = ["benchmarks/gpu_check.py", *sys.argv[1:]]
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
"""


def test_without_cuda_it_stops_at_the_first_cuda_call_and_writes_its_log(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_bare(_RUN + "\n", "--out", str(out), timeout_s=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "no CUDA device" in proc.stdout
    log = (out / "gpu_check.log").read_text()
    assert "no CUDA device" in log and "gpu_check: torch" in log
    assert json.loads((out / "gpu_check.json").read_text())["status"] == "no CUDA device"


def test_check_logprobs_close_follows_vllm() -> None:
    hf = [([5, 6, 7], [{5: -0.1, 9: -2.0}, {6: -0.5, 8: -0.6}, {7: -0.1}])] * 3
    ours = [
        ([5, 6, 7], [{5: -0.1}, {6: -0.5}, {7: -0.1}]),  # identical
        ([5, 8, 1], [{5: -0.1}, {8: -0.55, 6: -0.56}, {1: -0.1}]),  # a near-tie at 1; the rest is not compared
        ([9, 6, 7], [{9: -0.1}, {6: -0.5}, {7: -0.1}]),  # 9 is in HF's top, but HF's 5 is not in ours
    ]
    report = check_logprobs_close(ours, hf)
    assert report["identical"] == 1
    assert report["diverged_close"] == [{"seq": 1, "position": 1}]
    assert report["mismatch"] == [{"seq": 2, "position": 0, "raytp": 9, "hf": 5}]


def test_roofline_is_the_bytes_a_decode_step_reads_over_the_bandwidth() -> None:
    weights = 16_060_000_000  # Llama-3-8B in bf16
    fig = {
        "raytp_single_stream_ms_per_token": 6.0,
        "raytp_offline_output_tok_s": 9000.0,
        "hf_offline_output_tok_s": 1500.0,
    }
    roofline(fig, weights, 3.35e12)
    kv_token = 2 * LLAMA3_8B["num_hidden_layers"] * LLAMA3_8B["num_key_value_heads"] * 128 * 2
    assert fig["roofline_single_stream_ms_per_token"] == round((weights + kv_token * 256) / 3.35e12 * 1e3, 3)
    assert 0.79 < fig["fraction_of_roofline_single_stream"] < 0.81  # ~4.8 ms of 6.0 ms
    # Offline: 256 rows per decode step, each reading its KV at the mean context (512 + 128), weights once.
    step_bytes = weights + kv_token * 640 * 256
    assert fig["roofline_offline_decode_output_tok_s"] == round(256 / (step_bytes / 3.35e12), 1)
    assert fig["x_hf_offline"] == 6.0
