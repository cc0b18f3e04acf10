"""Recovery after a worker dies (issue 36): how long from a killed TP worker to the first correct answer.

Starts `raytp serve` as a user would (the embedded default model unless `--model`), takes a greedy reference
answer, starts a long stream, then SIGKILLs the engine's worker actor process (`ray::Worker`, what an
out-of-memory kill or a crashed kernel does). From the kill it times: the stream's end (its error event),
`/health` turning 503, `/health` answering 200 again, and the first request whose greedy answer equals the
reference. The model replica's own log then says where the time went (Serve's health checks, the new
replica's start, the engine's load): its timestamps are printed beside the outside view.

    python -m benchmarks.recovery                           # the default model, 3 kills
    python -m benchmarks.recovery --kills 1 --raytp-arg=--health-check-period-s=10   # Serve's own default
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from benchmarks.common.proc_mem import tree
from benchmarks.common.servers import ServerProcess, free_port

PROMPT = "The capital of France is"


def complete(base_url: str, model: str, timeout_s: float) -> str | None:
    """The greedy answer to PROMPT, or None when the server cannot answer now."""
    body: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    try:
        reply = requests.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    except requests.RequestException:
        return None
    if reply.status_code != 200:
        return None
    text: str = reply.json()["choices"][0]["text"]
    return text


def stream_until_error(base_url: str, model: str, started: threading.Event, ended: list[float]) -> None:
    """A long stream; `started` is set at its first token, `ended` gets the time its stream stops."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": "Count: 1, 2, 3,",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith(b"data:"):
                    started.set()
    except requests.RequestException:
        pass
    ended.append(time.perf_counter())


def worker_pids(root: int) -> list[int]:
    """The engine's TP worker actor processes in the server's tree (Ray titles them `ray::Worker...`)."""
    pids = []
    for pid in tree(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"ray::Worker"):
            pids.append(pid)
    return pids


def health(base_url: str) -> int:
    try:
        return requests.get(f"{base_url}/health", timeout=5).status_code
    except requests.RequestException:
        return 0


def one_kill(srv: ServerProcess, model: str, reference: str, timeout_s: float) -> dict[str, float]:
    started, ended = threading.Event(), list[float]()
    streamer = threading.Thread(target=stream_until_error, args=(srv.base_url, model, started, ended), daemon=True)
    streamer.start()
    if not started.wait(60):
        raise RuntimeError("the stream never started")
    (pid,) = worker_pids(srv.proc.pid)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    marks: dict[str, float] = {}
    while time.perf_counter() - t0 < timeout_s:
        now = time.perf_counter() - t0
        if "stream_ended_s" not in marks and ended:
            marks["stream_ended_s"] = ended[0] - t0
        status = health(srv.base_url)
        if "health_503_s" not in marks and status == 503:
            marks["health_503_s"] = now
        if "health_200_s" not in marks and status == 200 and "health_503_s" in marks:
            marks["health_200_s"] = time.perf_counter() - t0
        if "health_200_s" in marks and complete(srv.base_url, model, 30) == reference:
            marks["first_correct_s"] = time.perf_counter() - t0
            break
        time.sleep(0.1)
    else:
        raise TimeoutError(f"no correct answer within {timeout_s} s of the kill: {marks}")
    streamer.join(5)
    if "stream_ended_s" not in marks and ended:
        marks["stream_ended_s"] = ended[0] - t0
    return marks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2)")
    ap.add_argument("--kills", type=int, default=3, help="kill, recover, repeat this many times")
    ap.add_argument("--raytp-arg", action="append", default=[], help="extra `raytp serve` argument (repeatable)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a recovery may take")
    ap.add_argument("--log", default="/tmp/raytp_recovery.log")
    args = ap.parse_args()

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [str(Path(sys.executable).with_name("raytp")), "serve", *([args.model] if args.model else [])]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *args.raytp_arg]
    with open(args.log, "wb") as log:
        srv = ServerProcess("raytp", cmd, env, port, log, ray_tree=True)
        try:
            print(f"ready after {srv.wait_ready():.1f} s; command: {' '.join(cmd)}", flush=True)
            model = requests.get(f"{srv.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
            reference = complete(srv.base_url, model, 120)
            if reference is None:
                raise RuntimeError("no reference answer")
            runs = []
            for i in range(args.kills):
                marks = one_kill(srv, model, reference, args.timeout)
                runs.append(marks)
                print(f"kill {i + 1}: " + json.dumps({k: round(v, 2) for k, v in marks.items()}), flush=True)
        finally:
            srv.stop()
    print("\nmedian over kills (seconds from the SIGKILL):")
    for key in ("stream_ended_s", "health_503_s", "health_200_s", "first_correct_s"):
        values = [r[key] for r in runs if key in r]
        if values:
            print(f"  {key:16s} {statistics.median(values):6.2f}  (each: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
