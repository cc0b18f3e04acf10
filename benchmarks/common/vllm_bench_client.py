"""vLLM's own serving client (`vllm bench serve`) as the load generator, so a figure is the one vLLM reports.

`benchmarks/serving.py --client vllm-bench` measures each round with it instead of raytp's own client
(`serving_load.run_load`): vLLM's "random" dataset (random token ids, lengths drawn around a centre by a
range ratio), Poisson arrivals, streamed /v1/completions, `--ignore-eos`. Our `--input-len MIN MAX` /
`--output-len MIN MAX` become its centre and ratio: 128 384 -> `--random-input-len 256`, ratio 0.5 (256 ±
50%); 64 64 -> 64 exactly. Both servers get the same seed per round, so the same prompts.

The client runs in vLLM's venv. Its `vllm` console script looks up a distribution named `vllm` (which the
CPU build installed here does not register), so the benchmark's own entry point is called instead
(`vllm.benchmarks.serve.main`, what `vllm bench serve` runs). The result is read from the JSON it saves
(`--save-result`), and mapped to the keys `serving.py` prints (`summarize`'s names).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common.vllm_baseline import vllm_env, vllm_python

_ENTRY = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def centre_and_ratio(low: int, high: int) -> tuple[int, float]:
    """vLLM's random-dataset length as centre ± ratio (its lengths are drawn from [c(1-r), c(1+r)])."""
    if not 1 <= low <= high:
        raise ValueError(f"a length range needs 1 <= MIN <= MAX, got {low} {high}")
    centre = round((low + high) / 2)
    return centre, (high - low) / (high + low)


def served_model(base_url: str) -> str:
    """The first model name the server lists (the name requests must carry)."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])


def bench_serve_command(
    base_url: str,
    model: str,
    tokenizer: str,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    num_prompts: int,
    request_rate: float,
    seed: int,
    result_dir: str,
    result_file: str,
) -> list[str]:
    """The `vllm bench serve` invocation (as an argv for vLLM's interpreter) for one measured round."""
    isl, in_ratio = centre_and_ratio(*input_len)
    osl, out_ratio = centre_and_ratio(*output_len)
    return [
        str(vllm_python()),
        "-c",
        _ENTRY,
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(isl),
        "--random-output-len",
        str(osl),
        "--random-range-ratio",
        json.dumps({"input": in_ratio, "output": out_ratio}),
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        str(request_rate),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        result_file,
    ]


def summary_of(result: dict[str, Any], offered_rate: float) -> dict[str, Any]:
    """vLLM's saved result under the names `serving.py` prints and takes medians of."""
    out: dict[str, Any] = {
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "duration_s": result["duration"],
        "offered_rate": offered_rate,
        "request_throughput": result["request_throughput"],
        "output_token_throughput": result["output_throughput"],
        "total_token_throughput": result["total_token_throughput"],
        "output_tokens": result["total_output_tokens"],
        "errors": sorted({e for e in result.get("errors", []) if e})[:5],
    }
    for ours, theirs in (("ttft", "ttft"), ("itl", "itl"), ("tpot", "tpot"), ("e2e_latency", "e2el")):
        out[f"{ours}_mean_ms"] = result[f"mean_{theirs}_ms"]
        out[f"{ours}_p50_ms"] = result[f"median_{theirs}_ms"]
        out[f"{ours}_p99_ms"] = result[f"p99_{theirs}_ms"]
    return out


def bench_serve(
    base_url: str,
    tokenizer: str,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    num_prompts: int,
    request_rate: float,
    seed: int,
    log: Path | None = None,
) -> dict[str, Any]:
    """One round of `vllm bench serve` against a running server; raises with its output's tail if it fails."""
    with tempfile.TemporaryDirectory(prefix="raytp-vllm-bench-") as tmp:
        cmd = bench_serve_command(
            base_url,
            served_model(base_url),
            tokenizer,
            input_len,
            output_len,
            num_prompts,
            request_rate,
            seed,
            tmp,
            "result.json",
        )
        done = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True, check=False)
        if log is not None:
            with open(log, "a") as f:
                f.write(done.stdout + done.stderr)
        result_path = Path(tmp) / "result.json"
        if done.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
        return summary_of(json.loads(result_path.read_text()), request_rate)
