"""Online serving benchmark: Poisson arrivals against the OpenAI endpoint, streamed.

Workload (vLLM's "random" dataset style): `--num-prompts` requests with random token-id
prompts of `--input-len` tokens and `--output-len` output tokens (uniform ranges, fixed
seed, ignore_eos so every request generates exactly what it asked for), greedy. Requests
arrive as a Poisson process at `--request-rate` per second (inf: all at once), each as a
streaming /v1/completions call with usage.

    python benchmarks/serving.py --request-rate 2 --num-prompts 64      # starts its own server
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 ...   # or measures a running one

Reports request and token throughput, TTFT (time to the first streamed token), ITL (gaps
between streamed chunks of one request, i.e. inter-token latency) and end-to-end latency,
each as mean / p50 / p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    return [
        ([rng.randrange(100, args.vocab) for _ in range(rng.randint(lo_in, hi_in))], rng.randint(lo_out, hi_out))
        for _ in range(args.num_prompts)
    ]


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result()
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens == max_tokens
        if not res.ok:
            res.error = f"got {res.output_tokens} tokens, asked for {max_tokens}"
    except aiohttp.ClientError as e:
        res.error = repr(e)
    return res


async def run(args: argparse.Namespace, base_url: str) -> tuple[list[Result], float]:
    work = make_workload(args)
    rng = random.Random(args.seed + 1)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(f"{base_url}/v1/models", headers=args.headers) as resp:
            model = (await resp.json())["data"][0]["id"]
        session.headers.update(args.headers)
        url = f"{base_url}/v1/completions"
        tasks = []
        t0 = time.perf_counter()
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(one_request(session, url, model, prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def report(args: argparse.Namespace, results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.latency for r in ok]
    summary: dict[str, Any] = {
        "request_rate": args.request_rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
    }
    for name, xs in (("ttft", ttft), ("itl", itl), ("e2e_latency", e2e)):
        summary[f"{name}_mean_ms"] = 1000 * statistics.fmean(xs) if xs else float("nan")
        summary[f"{name}_p50_ms"] = 1000 * pct(xs, 50)
        summary[f"{name}_p99_ms"] = 1000 * pct(xs, 99)
    errors = sorted({r.error for r in results if not r.ok})
    print(f"{'requests completed / failed':<36}{len(ok)} / {len(results) - len(ok)}")
    print(f"{'duration (s)':<36}{duration:.1f}")
    print(f"{'request throughput (req/s)':<36}{summary['request_throughput']:.2f}")
    print(f"{'output throughput (tok/s)':<36}{summary['output_token_throughput']:.1f}")
    print(f"{'total throughput (tok/s)':<36}{summary['total_token_throughput']:.1f}")
    for name, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e_latency", "E2E latency")):
        print(
            f"{label + ' mean / p50 / p99 (ms)':<36}{summary[name + '_mean_ms']:.1f} / "
            f"{summary[name + '_p50_ms']:.1f} / {summary[name + '_p99_ms']:.1f}"
        )
    for e in errors[:5]:
        print("error:", e)
    return summary


def start_server(args: argparse.Namespace) -> str:
    """An in-process server (this process is the Ray driver) on a free local port."""
    import socket

    import ray
    from ray import serve

    from serve_app import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine: dict[str, Any] = {"model": args.model, "tensor_parallel_size": args.tensor_parallel_size}
    if args.max_model_len is not None:
        engine["max_model_len"] = args.max_model_len
    serve.run(build_app(engine), name="raytp-bench", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server; default: start one in this process")
    p.add_argument("--model", default=None, help="model for the started server (default: embedded SmolLM2)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=float, default=2.0, help="requests/s (Poisson); inf = all at once")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--vocab", type=int, default=10000, help="prompt token ids are drawn from [100, VOCAB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the summary to this file")
    args = p.parse_args()
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base_url = args.base_url or start_server(args)
    try:
        results, duration = asyncio.run(run(args, base_url.rstrip("/")))
        summary = report(args, results, duration)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    finally:
        if args.base_url is None:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()


if __name__ == "__main__":
    main()
