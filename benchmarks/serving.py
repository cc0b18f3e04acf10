"""Online serving benchmark: Poisson arrivals against OpenAI endpoints, streamed; raytp alone or against vLLM.

Workload (vLLM's "random" dataset style): `--num-prompts` requests with random token-id prompts of
`--input-len` tokens and `--output-len` output tokens (uniform ranges, seeded, ignore_eos so every
request generates exactly what it asked for), greedy. Requests arrive as a Poisson process at
`--request-rate` per second (inf: all at once), each a streaming /v1/completions call with usage.

    python benchmarks/serving.py --request-rate 2 --num-prompts 64      # starts raytp in this process
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 ...   # or measures a running server
    python benchmarks/serving.py --baseline vllm --request-rate 1 --num-prompts 32 --rounds 2
    python benchmarks/serving.py --baseline vllm --find-max-rate        # highest sustained rate of each
    python benchmarks/serving.py --ab=--async-scheduling --rounds 4     # raytp with and without a flag
    python benchmarks/serving.py --baseline vllm --client vllm-bench --request-rate 2 --num-prompts 64 \
        --input-len 128 384 --output-len 64 64 --rounds 4               # measured by vLLM's own client

`--baseline vllm` starts `raytp serve` and vLLM's OpenAI server as subprocesses on the same fp32
safetensors directory with the same 4 GiB KV budget, then measures them in interleaved rounds (raytp,
vLLM, raytp, vLLM, ...), each round a fresh request set (no prefix cache helps) with the same arrival
times for both, and the other server paused (SIGSTOP) meanwhile. Reports completed req/s, TTFT and
ITL (gaps between streamed chunks of a request) p50/p99 per engine (medians over rounds), peak memory
of each server's process tree, and the ratios.

`--find-max-rate` searches each server's highest sustained request rate: doubling from
`--start-rate` until a rate is not sustained, then bisecting `--search-steps` times; each probe
sends max(`--num-prompts`, rate x `--probe-seconds`) requests. Sustained means every request
completed and, over the last two thirds of the arrival window, the server finished at least 0.9x as
many requests as had arrived one request latency earlier (`serving_load.sustained`). With a
baseline the two searches advance probe by probe.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import statistics
import sys
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common.serving_load import run_load, summarize
from benchmarks.common.workload import Request, random_requests

RateSearch = Generator[float, bool, float]


def workload(args: argparse.Namespace, n: int, round_index: int) -> list[Request]:
    return random_requests(n, tuple(args.input_len), tuple(args.output_len), args.vocab, args.seed, round_index)


def measure(
    args: argparse.Namespace, base_url: str, work: list[Request], rate: float, round_index: int = 0
) -> dict[str, Any]:
    """One round of load against one server: raytp's client on `work`, or with `--client vllm-bench` vLLM's
    `vllm bench serve` on its own random prompts of the same lengths (seeded per round: both servers of a
    round get the same ones)."""
    if args.client == "vllm-bench":
        from benchmarks.common.hf_model import hf_model_dir
        from benchmarks.common.vllm_bench_client import bench_serve

        log = Path(args.log_dir) / "vllm-bench.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        io = (tuple(args.input_len), tuple(args.output_len))
        return bench_serve(base_url, hf_model_dir(args.model), *io, len(work), rate, args.seed + round_index, log)
    results, duration = asyncio.run(run_load(base_url, work, rate, args.seed + 1, args.headers))
    return summarize(results, duration, rate)


def print_summary(summary: dict[str, Any]) -> None:
    print(f"{'requests completed / failed':<36}{summary['completed']:g} / {summary['failed']:g}")
    print(f"{'duration (s)':<36}{summary['duration_s']:.1f}")
    print(
        f"{'request throughput (req/s)':<36}{summary['request_throughput']:.2f}"
        f"  (offered {summary['offered_rate']:.2f})"
    )
    print(f"{'output throughput (tok/s)':<36}{summary['output_token_throughput']:.1f}")
    print(f"{'total throughput (tok/s)':<36}{summary['total_token_throughput']:.1f}")
    for name, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e_latency", "E2E latency")):
        print(
            f"{label + ' mean / p50 / p99 (ms)':<36}{summary[name + '_mean_ms']:.1f} / "
            f"{summary[name + '_p50_ms']:.1f} / {summary[name + '_p99_ms']:.1f}"
        )
    for e in summary["errors"]:
        print("error:", e)


def rate_search(start: float, limit: float, steps: int) -> RateSearch:
    """Yields rates to probe, is sent whether each was sustained; returns the highest sustained one (0: none)."""
    good, bad, rate = 0.0, math.inf, start
    while rate <= limit:
        if (yield rate):
            good, rate = rate, rate * 2
        else:
            bad = rate
            break
    if bad == math.inf:
        return good
    for _ in range(steps):
        mid = (good + bad) / 2 if good else bad / 2
        if (yield mid):
            good = mid
        else:
            bad = mid
    return good


def find_max_rates(
    args: argparse.Namespace,
    servers: dict[str, str],
    running: Callable[[str], AbstractContextManager[None]] = lambda _name: contextlib.nullcontext(),
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Each server's highest sustained rate, and every probe's summary (with `server` and `probe` added);
    the searches take turns, one probe each per turn, each probe inside `running(name)` (side by side:
    that server resumed, the other paused)."""
    searches = {name: rate_search(args.start_rate, args.max_rate, args.search_steps) for name in servers}
    next_rate = {name: next(s) for name, s in searches.items()}
    found: dict[str, float] = {}
    probes: list[dict[str, Any]] = []
    probe = 0
    while next_rate:
        probe += 1
        for name, rate in list(next_rate.items()):
            n = max(args.num_prompts, math.ceil(rate * args.probe_seconds))
            with running(name):
                summary = measure(args, servers[name], workload(args, n, 1000 + probe), rate)
            ok = summary["sustained"]
            probes.append({"server": name, "probe": probe, **summary})
            print(
                f"probe {probe} {name:>5} @ {rate:6.2f} req/s ({n} req): {'sustained' if ok else 'NOT sustained'} "
                f"(served {summary['service_ratio']:.2f}x the arrivals); "
                f"{summary['request_throughput']:.2f} req/s done, TTFT p50 {summary['ttft_p50_ms']:.0f} ms, "
                f"ITL p50 {summary['itl_p50_ms']:.0f} ms, failed {summary['failed']}",
                flush=True,
            )
            try:
                next_rate[name] = searches[name].send(ok)
            except StopIteration as done:
                found[name] = done.value
                del next_rate[name]
    return found, probes


def start_inprocess_server(args: argparse.Namespace) -> str:
    """An in-process server (this process is the Ray driver) on a free local port."""
    import ray
    from ray import serve

    from benchmarks.common.servers import free_port
    from serve_app import build_app

    port = free_port()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine: dict[str, Any] = {"model": args.model, "tensor_parallel_size": args.tensor_parallel_size}
    if args.max_model_len is not None:
        engine["max_model_len"] = args.max_model_len
    serve.run(build_app(engine), name="raytp-bench", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def run_alone(args: argparse.Namespace) -> None:
    base_url = (args.base_url or start_inprocess_server(args)).rstrip("/")
    try:
        if args.find_max_rate:
            found, probes = find_max_rates(args, {"raytp": base_url})
            print(f"highest sustained rate: {found['raytp']:.2f} req/s")
            _write_json(args, probes)
            return
        summaries = [
            measure(args, base_url, workload(args, args.num_prompts, r), args.request_rate, r)
            for r in range(args.rounds)
        ]
        for s in summaries:
            print_summary(s)
        _write_json(args, summaries[-1] if len(summaries) == 1 else summaries)
    finally:
        if args.base_url is None:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()


def run_against_vllm(args: argparse.Namespace) -> None:
    from benchmarks.common.hf_model import hf_model_dir
    from benchmarks.common.servers import free_port, start_raytp, start_vllm

    model_dir = hf_model_dir(args.model)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    # Both boot at once (boot time is not measured); vLLM first, it takes longer.
    vllm = start_vllm(model_dir, free_port(), open(logs / "vllm.log", "wb"))  # noqa: SIM115 (the server's lifetime)
    raytp = start_raytp(model_dir, free_port(), open(logs / "raytp.log", "wb"), args.raytp_arg)  # noqa: SIM115
    try:
        for srv in (raytp, vllm):
            print(f"{srv.name} ready after {srv.wait_ready():.0f} s at {srv.base_url} (log: {logs / srv.name}.log)")
        servers = {"raytp": raytp, "vllm": vllm}
        urls = {name: srv.base_url for name, srv in servers.items()}
        for srv in servers.values():
            srv.pause()  # each runs only while it is measured (benchmarks/common/servers.py says why)
        if args.find_max_rate:
            found, probes = find_max_rates(args, urls, lambda name: servers[name].running())
            print(f"highest sustained rate: raytp {found['raytp']:.2f} req/s, vllm {found['vllm']:.2f} req/s")
            if found["vllm"]:
                print(f"raytp / vllm: {found['raytp'] / found['vllm']:.2f}x")
            _write_json(args, probes)
            return
        summaries: dict[str, list[dict[str, Any]]] = {"raytp": [], "vllm": []}
        for r in range(args.rounds):
            work = workload(args, args.num_prompts, r)
            for name, url in urls.items():
                with servers[name].running():
                    s = measure(args, url, work, args.request_rate, r)
                summaries[name].append(s)
                print(
                    f"round {r + 1} {name:>5}: {s['request_throughput']:.2f} req/s, "
                    f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, ITL p50 {s['itl_p50_ms']:.0f} ms, failed {s['failed']}",
                    flush=True,
                )
        med = {name: _medians(ss) for name, ss in summaries.items()}
        for name in urls:
            print(f"\n== {name} (median of {args.rounds} round(s))")
            print_summary(med[name])
        _print_table(args, med)
        _write_json(args, summaries)
    finally:
        for srv in (raytp, vllm):
            tree, engine = srv.stop()
            print(
                f"{srv.name} server: {tree.describe()}"
                + (f"; without Ray's daemons: {engine.describe()}" if engine else "")
            )


def _write_json(args: argparse.Namespace, data: Any) -> None:
    """`--json FILE`: the run's summaries (a search's: one per probe) as JSON."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)


def _medians(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(summaries[0])
    for key, value in summaries[0].items():
        if isinstance(value, float | int) and not isinstance(value, bool):
            out[key] = statistics.median(s[key] for s in summaries)
    out["errors"] = sorted({e for s in summaries for e in s["errors"]})[:5]
    return out


def _print_table(args: argparse.Namespace, med: dict[str, dict[str, Any]]) -> None:
    """The issue's serving row, ready to paste."""

    def cell(s: dict[str, Any]) -> str:
        return (
            f"{s['request_throughput']:.2f} req/s; TTFT p50 {s['ttft_p50_ms']:,.0f} ms (p99 {s['ttft_p99_ms']:,.0f}); "
            f"ITL p50 {s['itl_p50_ms']:,.0f} ms (p99 {s['itl_p99_ms']:,.0f})"
        )

    r, v = med["raytp"], med["vllm"]
    print("\n| workload | vllm | raytp | raytp / vllm |\n| --- | --- | --- | --- |")
    print(
        f"| serve, --request-rate {args.request_rate:g} --num-prompts {args.num_prompts} | {cell(v)} | {cell(r)} "
        f"| {r['request_throughput'] / v['request_throughput']:.2f}× req/s; "
        f"TTFT p50 {r['ttft_p50_ms'] / v['ttft_p50_ms']:.2f}×, ITL p50 {r['itl_p50_ms'] / v['itl_p50_ms']:.2f}× |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", choices=("vllm", "none"), default="none")
    p.add_argument("--base-url", default=None, help="measure a running server (no baseline); default: start raytp")
    p.add_argument("--model", default=None, help="model for the started server(s) (default: embedded SmolLM2)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=float, default=2.0, help="requests/s (Poisson); inf = all at once")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--vocab", type=int, default=10000, help="prompt token ids are drawn from [100, VOCAB - 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="default: 2 with --baseline vllm, else 1; interleaved rounds, fresh prompts each (medians reported)",
    )
    p.add_argument("--find-max-rate", action="store_true", help="search the highest sustained request rate")
    p.add_argument("--start-rate", type=float, default=0.5)
    p.add_argument("--max-rate", type=float, default=64.0)
    p.add_argument("--search-steps", type=int, default=3, help="bisection steps after the doubling phase")
    p.add_argument("--probe-seconds", type=float, default=60.0, help="arrival window of each search probe")
    p.add_argument("--raytp-arg", action="append", default=[], help="extra `raytp serve` flag (repeatable)")
    p.add_argument(
        "--ab",
        default=None,
        metavar="FLAGS",
        help="compare `raytp serve` with and without FLAGS (one string: --ab=--async-scheduling), alternating "
        "rounds, one server at a time (benchmarks/common/serving_ab.py)",
    )
    p.add_argument(
        "--client",
        choices=("raytp", "vllm-bench"),
        default="raytp",
        help="the load generator: raytp's own (benchmarks/common/serving_load.py) or vLLM's `vllm bench serve` "
        "(random dataset; --input-len/--output-len as centre +- ratio; benchmarks/common/vllm_bench_client.py)",
    )
    p.add_argument("--log-dir", default="/tmp/raytp-serving-bench", help="the servers' logs (with --baseline)")
    p.add_argument("--json", default=None, help="also write the summaries (of a search: every probe's) to this file")
    args = p.parse_args()
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.rounds is None:  # a comparison needs medians of >= 2 interleaved rounds
        args.rounds = 2 if args.baseline == "vllm" else 1
    if args.client == "vllm-bench" and (args.ab is not None or args.find_max_rate or args.api_key):
        p.error("--client vllm-bench measures fixed-rate rounds: no --ab, --find-max-rate or --api-key")
    if args.ab is not None:
        if args.baseline == "vllm" or args.base_url:
            p.error("--ab compares two raytp servers it starts itself; no --baseline or --base-url")
        from benchmarks.common.serving_ab import compare_flags

        compare_flags(
            {"plain": args.raytp_arg, args.ab: [*args.raytp_arg, *shlex.split(args.ab)]},
            rounds=max(2, args.rounds),
            num_prompts=args.num_prompts,
            input_len=tuple(args.input_len),
            output_len=tuple(args.output_len),
            request_rate=args.request_rate,
            model=args.model,
        )
    elif args.baseline == "vllm":
        if args.base_url:
            p.error("--baseline vllm starts both servers itself; --base-url is for measuring one running server")
        run_against_vllm(args)
    else:
        run_alone(args)


if __name__ == "__main__":
    main()
