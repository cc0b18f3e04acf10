"""Where a served request's time goes: client TTFT against the engine's, and CPU per process per token.

Starts `raytp serve` (a subprocess with a private Ray) on the fp32 benchmark model, sends a Poisson
load (default 1 req/s), and reports:

- TTFT and ITL as the client sees them against the engine's own (`raytp:time_to_first_token_seconds`,
  `raytp:inter_token_latency_seconds`, measured in the controller from add_request to publish): the
  difference is the path outside the engine (HTTP proxy, ingress, LLMServer relay, the Ray hops);
- the controller's step time against the worker's execute time (`engine_step_time_seconds` vs
  `worker_step_time_seconds`): the difference is scheduling, the Ray call and update/detokenize;
- CPU seconds of every process of the tree during the load, by role (proxy, ingress, LLMServer,
  controller, worker, Ray daemons), also per output token: on a 2-core machine every CPU ms a hop
  spends is taken from the model;
- with `--py-spy`, the hottest functions (own samples while holding the GIL) of the ingress, the
  LLMServer replica and the controller; and the model worker's samples (all, its ops drop the GIL) by
  phase of its step: input preparation, forward, sampler, the rest (`print_phases`).

The engine-side figures come from Ray's exported histograms (sum / count deltas around the load),
so they are means, not percentiles. Ray's OpenTelemetry recorder re-records each observation at its
bucket's midpoint (`open_telemetry_metric_recorder._histogram_bucket_midpoints`), so a histogram's own
sum is off by up to half a bucket per observation (seen: engine TTFT ~0.9 s above the client's); the
sums used here are raytp's exact ones (`<histogram>_sum_exact_total`, counters of the observed values).

    python -m benchmarks.serving_profile [--request-rate 1 --num-prompts 24] [--py-spy]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common.proc_mem import tree
from benchmarks.common.serving_load import run_load, summarize
from benchmarks.common.workload import random_requests

_TICK = os.sysconf("SC_CLK_TCK")
_HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "engine_step_time_seconds",
    "worker_step_time_seconds",
    "request_queue_time_seconds",
)
METRICS_EXPORT_WAIT_S = 15.0  # Ray's metrics agent re-exports every few seconds; wait for the last values


def histogram_sums(base_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each engine histogram in _HISTOGRAMS, summed over label sets. The sum is the exact one
    where raytp exports it beside the histogram (`<name>_sum_exact_total`, a counter of the observed values),
    else the histogram's own `_sum`, which Ray re-records at bucket midpoints (see the module note)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list[float]] = {h: [0.0, 0.0] for h in _HISTOGRAMS}
    exact: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for h in _HISTOGRAMS:
            if family.name.endswith("raytp_" + h):
                for s in family.samples:
                    if s.name.endswith("_sum"):
                        out[h][0] += s.value
                    elif s.name.endswith("_count"):
                        out[h][1] += s.value
            elif family.name.endswith("raytp_" + h + "_sum_exact"):
                exact[h] = exact.get(h, 0.0) + sum(s.value for s in family.samples if s.name.endswith("_total"))
    return {h: (exact.get(h, v[0]), v[1]) for h, v in out.items()}


def role(pid: int) -> str:
    """A process's part in the serving path, from its title (Ray workers carry `ray::<actor or task>`)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    if cmd.startswith("ray::"):
        title = cmd.split()[0].removeprefix("ray::")
        for key in ("OpenAIIngress", "LLMServer", "ProxyActor", "ServeController", "EngineController"):
            if key in title:
                return key
        return title.split(".")[0].split(":")[0]  # Worker, IDLE, ...
    if "raytp serve" in cmd or Path(cmd.split()[0]).name == "raytp":
        return "raytp serve (driver)"
    for daemon in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "agent"):
        if daemon in cmd:
            return f"ray daemon: {daemon}"
    return Path(cmd.split()[0]).name if cmd else "?"


def cpu_seconds(root: int) -> dict[int, tuple[str, float]]:
    out = {}
    for pid in tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (role(pid), (int(fields[11]) + int(fields[12])) / _TICK)  # utime + stime
    return out


def py_spy_top(pid: int, seconds: float, out_dir: Path, name: str, gil: bool = True) -> subprocess.Popen[bytes]:
    spy = str(Path(sys.executable).with_name("py-spy"))
    raw = out_dir / f"{name}.txt"
    # --gil: only samples where a thread holds the GIL, i.e. Python work; without it Ray's core-worker
    # loop, blocked in native code, fills most samples of every actor. The model worker is sampled without
    # it (`gil=False`): torch's ops release the GIL while they compute, and that time is what it is for.
    cmd = [
        spy,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(int(seconds)),
        "--rate",
        "200",
        "--format",
        "raw",
        *(["--gil"] if gil else []),
    ]
    return subprocess.Popen(
        [*cmd, "--output", str(raw), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def print_hot(raw: Path, top: int = 8) -> None:
    """Own-sample share of the hottest frames in a py-spy raw (collapsed stacks) file."""
    if not raw.is_file():
        print(f"  (no py-spy output for {raw.stem})")
        return
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        own[stack.split(";")[-1]] += int(count)
        total += int(count)
    print(f"  {raw.stem}: {total} active samples")
    for frame, n in own.most_common(top):
        print(f"    {100 * n / total:5.1f}%  {frame[:110]}")


# The model worker's step by phase: a sample counts for the innermost phase whose frame is in its stack (py-spy
# names a frame `Class.method (file:line)`).
WORKER_PHASES = (
    (
        "input preparation",
        ("ModelRunner._apply_deltas ", "ModelRunner._host_inputs ", "ModelRunner._fill_placeholders"),
    ),
    ("model forward", ("ModelRunner._forward ",)),
    ("sampler", ("ModelRunner._sample ",)),
    ("step (rest: unpickle, block ops, outputs)", ("Worker.execute_model ",)),
)


def print_phases(raw: Path, phases: tuple[tuple[str, tuple[str, ...]], ...] = WORKER_PHASES) -> None:
    """Each phase's share of a py-spy raw file's samples (inclusive), the rest as "outside the step"."""
    if not raw.is_file():
        return
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        frames = stack.split(";")
        phase = "outside the step (Ray, idle loop)"
        for f in reversed(frames):
            hit = next((name for name, keys in phases if any(f.startswith(k) for k in keys)), None)
            if hit is not None:
                phase = hit
                break
        counts[phase] += int(count)
    print(f"  {raw.stem} by phase ({total} samples):")
    for name, n in counts.most_common():
        print(f"    {100 * n / max(total, 1):5.1f}%  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--request-rate", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--py-spy", action="store_true", help="also sample the ingress, LLMServer and controller")
    ap.add_argument("--raytp-arg", action="append", default=[], help="extra `raytp serve` flag (repeatable)")
    ap.add_argument("--log-dir", default="/tmp/raytp-serving-profile")
    args = ap.parse_args()

    from benchmarks.common.hf_model import hf_model_dir
    from benchmarks.common.servers import free_port, start_raytp

    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    server = start_raytp(hf_model_dir(args.model), free_port(), open(logs / "raytp.log", "wb"), args.raytp_arg)  # noqa: SIM115
    try:
        print(f"raytp ready after {server.wait_ready():.0f} s")
        url = server.base_url
        warm = random_requests(2, (64, 64), (8, 8), 10000, args.seed, -1)
        asyncio.run(run_load(url, warm, float("inf"), 0, {}))
        time.sleep(METRICS_EXPORT_WAIT_S)
        before_m, before_cpu = histogram_sums(url), cpu_seconds(server.proc.pid)
        work = random_requests(args.num_prompts, tuple(args.input_len), tuple(args.output_len), 10000, args.seed, 0)
        spies = []
        if args.py_spy:
            expected = args.num_prompts / args.request_rate + 10
            for pid, (r, _) in before_cpu.items():
                if r in ("OpenAIIngress", "LLMServer", "EngineController"):
                    spies.append((r, py_spy_top(pid, expected, logs, r)))
                elif r == "Worker":  # the model's rank: where its step's time goes besides the forward
                    spies.append((r, py_spy_top(pid, expected, logs, r, gil=False)))
        t0 = time.perf_counter()
        results, duration = asyncio.run(run_load(url, work, args.request_rate, args.seed + 1, {}))
        wall = time.perf_counter() - t0
        after_cpu = cpu_seconds(server.proc.pid)
        time.sleep(METRICS_EXPORT_WAIT_S)
        after_m = histogram_sums(url)
        s = summarize(results, duration, args.request_rate)
        out_tokens = s["output_tokens"]

        def mean_ms(h: str) -> tuple[float, int]:
            ds, dc = after_m[h][0] - before_m[h][0], after_m[h][1] - before_m[h][1]
            return (1000 * ds / dc if dc else float("nan")), int(dc)

        print(
            f"\nload: {s['completed']} requests at {args.request_rate:g} req/s, "
            f"{out_tokens} output tokens, {wall:.1f} s"
        )
        ttft_e, n_ttft = mean_ms("time_to_first_token_seconds")
        itl_e, _ = mean_ms("inter_token_latency_seconds")
        step_e, n_steps = mean_ms("engine_step_time_seconds")
        step_w, _ = mean_ms("worker_step_time_seconds")
        queue_e, _ = mean_ms("request_queue_time_seconds")
        print(
            f"TTFT mean: client {s['ttft_mean_ms']:.0f} ms, engine {ttft_e:.0f} ms ({n_ttft} requests) "
            f"-> outside the engine {s['ttft_mean_ms'] - ttft_e:.0f} ms"
        )
        print(f"  of the engine's: waiting queue {queue_e:.0f} ms (mean)")
        print(
            f"ITL mean:  client {s['itl_mean_ms']:.0f} ms, engine {itl_e:.0f} ms "
            f"-> outside {s['itl_mean_ms'] - itl_e:.0f} ms"
        )
        print(
            f"step mean: controller {step_e:.1f} ms, worker execute {step_w:.1f} ms ({n_steps} steps) "
            f"-> schedule + Ray call + update {step_e - step_w:.1f} ms"
        )
        by_role: dict[str, float] = collections.defaultdict(float)
        for pid, (r, cpu) in after_cpu.items():
            by_role[r] += cpu - before_cpu.get(pid, (r, 0.0))[1]
        total = sum(by_role.values())
        print(f"CPU seconds during the load ({wall:.0f} s wall, 2 cores = {2 * wall:.0f} CPU-s), per output token:")
        for r, cpu in sorted(by_role.items(), key=lambda kv: -kv[1]):
            if cpu >= 0.05:
                print(
                    f"  {r:<28}{cpu:7.1f} s  {100 * cpu / total:5.1f}%  {1000 * cpu / max(out_tokens, 1):6.2f} ms/token"
                )
        for name, spy in spies:
            spy.wait(timeout=120)
            print_hot(logs / f"{name}.txt")
            if name == "Worker":
                print_phases(logs / f"{name}.txt")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
