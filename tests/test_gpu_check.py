"""benchmarks/gpu_check.py on a machine without a GPU: it runs, on the bare box's packages only, up to its
first CUDA call and stops there saying so, with its log written; its pure helpers are checked here too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.gpu_profile import _union_us, kernel_kind, teacher_forced
from benchmarks.gpu_check import LLAMA3_8B, ROOT, check_logprobs_close, roofline
from cluster.outputs import Logprob
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
    fig = {"single_stream_ms_per_token": 6.0, "offline_output_tok_s": 9000.0}
    roofline(fig, weights, 3.35e12, 1500.0)
    kv_token = 2 * LLAMA3_8B["num_hidden_layers"] * LLAMA3_8B["num_key_value_heads"] * 128 * 2
    assert fig["roofline_single_stream_ms_per_token"] == round((weights + kv_token * 256) / 3.35e12 * 1e3, 3)
    assert 0.79 < fig["fraction_of_roofline_single_stream"] < 0.81  # ~4.8 ms of 6.0 ms
    # Offline: 256 rows per decode step, each reading its KV at the mean context (512 + 128), weights once.
    step_bytes = weights + kv_token * 640 * 256
    assert fig["roofline_offline_decode_output_tok_s"] == round(256 / (step_bytes / 3.35e12), 1)
    assert fig["x_hf_offline"] == 6.0


def test_kernels_are_sorted_by_their_names() -> None:
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_kind("nvjet_hsh_128x64_64x4_1x2_h_bz_TNT") == "gemm"
    assert kernel_kind("paged_attention_kernel") == "attention"
    assert kernel_kind("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kernel_kind("_rms_norm_kernel") == "other"


def test_device_busy_time_is_the_union_of_the_intervals() -> None:
    assert _union_us([]) == 0.0
    assert _union_us([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == 4.0


def test_teacher_forced_parity_compares_every_position() -> None:
    seqs = [[1, 2, 0]]
    hf = torch.log_softmax(torch.tensor([[[0.0, 0.0, 3.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]]), dim=-1)
    ours: list[list[dict[int, Any] | None]] = [
        [
            None,
            {2: Logprob(float(hf[0, 0, 2]) - 0.1, 1)},  # agrees: 2 is HF's top-1 at position 0
            {0: Logprob(float(hf[0, 1, 0]), 2), 1: Logprob(-0.5, 1)},  # disagrees: ours says 1
        ]
    ]
    report = teacher_forced(ours, hf, seqs, first=1)
    assert report["positions"] == 2 and report["top1_agreement"] == 0.5
    assert abs(report["max_abs_delta_logprob"] - 0.1) < 1e-6


def test_the_phases_run_on_a_cpu_with_a_small_model(tmp_path: Path) -> None:
    """--smoke-cpu: every phase but env and cuda_tests, on the CPU, so a GPU run never meets a Python error."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--out", str(out), "--smoke-cpu", "--budget-s", "600"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phases = json.loads((out / "gpu_check.json").read_text())["phases"]
    assert [p for p, v in phases.items() if v["status"] == "ok"] == ["tiny", "hf8b", "sync", "async", "fp8", "kvfull"]
    assert phases["fp8"]["parity_teacher_forced"]["positions"] == 252
    for name in ("sync", "async"):
        # an off-by-one position would agree ~1/512 of the time; bf16 near-ties may differ
        assert phases[name]["parity_teacher_forced"]["top1_agreement"] >= 0.9
        assert phases[name]["decode_8_rows"]["step_ms"] > 0
    assert phases["async"]["greedy_tokens_identical_to_sync"] == 4
    # the road a CUDA run takes: launched in place, resolved on the host thread (model_exec/step_launch.py)
    assert phases["async"]["async_road"] == phases["tiny"]["async_async_road"] == "launch"
    assert phases["sync"]["async_road"] is None
