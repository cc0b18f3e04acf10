"""Batch driver memory against the input's length: peak RSS of the `raytp batch` driver at several sizes.

Each size runs in a fresh child process that is the job's driver, exactly as `raytp batch` is: it
starts a local Ray (whose GCS, raylet and workers are processes of their own, not counted), reads the
input file, journals each answered row and writes the output files via `run_batch`. Its peak RSS is
the kernel's high-water mark for that process alone (`getrusage(RUSAGE_SELF).ru_maxrss`), taken after
the job finished; "RSS before" is VmRSS once Ray is up and every module the job uses is imported, so
"growth" is what the job itself added (all figures MiB; rows/s include starting the engine replica).
A tiny random-weight Llama answers `max_tokens` 1 completions, so the driver's per-row work (reading,
journalling, progress) dominates, as it would on a long file.

    python -m benchmarks.batch_memory --rows 2000 20000   # from the repository root
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"max_model_len": 128, "kv_cache_memory_bytes": 1 << 26, "swap_space": 0.01}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def write_input(path: Path, rows: int) -> None:
    with open(path, "w", encoding="utf-8") as f:  # streamed: the benchmark parent stays small too
        for i in range(rows):
            body = {"prompt": f"Row {i}: say something.", "max_tokens": 1, "temperature": 0}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def one_job(model: str, rows: int, work: Path, batch_size: int, num_cpus: int) -> dict[str, float]:
    """Run in the child: the driver of one job over `rows` generated lines."""
    import ray
    import ray.data  # noqa: F401  (imported before "RSS before": module code is not the job's growth)
    import tqdm  # noqa: F401

    import raytp.batch.replica  # noqa: F401
    from cluster.config import EngineConfig
    from raytp.batch.runner import BatchJob, run_batch

    src = work / "in.jsonl"
    write_input(src, rows)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    job = BatchJob(str(src), str(work / "out.jsonl"), None, EngineConfig(model=model, **ENGINE),  # type: ignore[arg-type]
                   batch_size=batch_size, show_progress=False)  # fmt: skip
    before = _rss_mib()
    t0 = time.perf_counter()
    status = run_batch(job)
    took = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    ray.shutdown()
    assert status.status == "completed" and status.completed == rows, status.to_dict()
    return {"rows": rows, "seconds": took, "rss_before_mib": before, "peak_rss_mib": peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--batch-size", type=int, default=64, help="rows per replica call (--max-concurrency)")
    ap.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of each job's local Ray")
    ap.add_argument("--model", default=None, help="default: a tiny random-weight Llama made here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        if args.child:
            print(json.dumps(one_job(args.model, args.rows[0], Path(d), args.batch_size, args.num_cpus)))
            return 0
        model = args.model
        if model is None:
            from tests.helpers.tiny_models import make_tiny_llama

            model = make_tiny_llama(Path(d) / "model")
        print(f"{'rows':>7} {'seconds':>8} {'rows/s':>8} {'RSS before MiB':>15} {'peak RSS MiB':>13} {'growth':>8}")
        for n in args.rows:
            cmd = [sys.executable, "-m", "benchmarks.batch_memory", "--child", "--rows", str(n), "--model", model,
                   "--batch-size", str(args.batch_size), "--num-cpus", str(args.num_cpus)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            growth = r["peak_rss_mib"] - r["rss_before_mib"]
            print(f"{n:>7} {r['seconds']:>8.1f} {n / r['seconds']:>8.1f} {r['rss_before_mib']:>15.1f} "
                  f"{r['peak_rss_mib']:>13.1f} {growth:>8.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
