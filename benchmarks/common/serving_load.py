"""The serving benchmark's load: Poisson arrivals of streamed /v1/completions calls, and what they measured.

Any OpenAI-compatible server works (raytp serve, vLLM's api_server): token-id prompts, ignore_eos,
greedy, `stream_options.include_usage`, so every request generates exactly what it asked for and the
server's own usage block confirms it.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.common.workload import Request


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent: float = 0.0  # perf_counter when the request left
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


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
    start = last = res.sent = time.perf_counter()
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


async def run_load(
    base_url: str, work: list[Request], rate: float, arrival_seed: int, headers: dict[str, str]
) -> tuple[list[Result], float]:
    """Sends `work` in order at Poisson `rate` (inf: all at once); (results in arrival order, seconds)."""
    rng = random.Random(arrival_seed)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
            model = (await resp.json())["data"][0]["id"]
        session.headers.update(headers)
        url = f"{base_url}/v1/completions"
        tasks = []
        t0 = time.perf_counter()
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(one_request(session, url, model, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summarize(results: list[Result], duration: float, rate: float) -> dict[str, Any]:
    """Throughput and latency figures (ms) of one run; `errors` lists up to five distinct failures."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    sends = [r.sent for r in results]
    span = max(sends) - min(sends)
    summary: dict[str, Any] = {
        "request_rate": rate,
        # what the Poisson draw actually offered: requests over the span of their arrivals
        "offered_rate": (len(results) - 1) / span if span > 0 and rate != float("inf") else float("inf"),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "service_ratio": service_ratio(results),
        "sustained": sustained(results),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "itl": [x for r in ok for x in r.itl],
        "e2e_latency": [r.latency for r in ok],
        # time per output token after the first (vLLM's TPOT): unlike ITL, it does not depend on how many
        # tokens one streamed chunk carries (speculative decoding sends several at once)
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
    }
    for name, xs in series.items():
        summary[f"{name}_mean_ms"] = 1000 * statistics.fmean(xs) if xs else float("nan")
        summary[f"{name}_p50_ms"] = 1000 * pct(xs, 50)
        summary[f"{name}_p99_ms"] = 1000 * pct(xs, 99)
    return summary


def service_ratio(results: list[Result]) -> float:
    """How fast the server finished requests against how fast they arrived, once the pipeline had filled:
    completions over the last two thirds of the arrival window over the arrivals one request latency
    earlier (1.0: it kept pace; 0.0: the probe cannot show it, e.g. a latency as long as the probe).

    Once the first third has filled the pipeline, a server that keeps up finishes requests at the rate
    they arrive, one request latency L later; one that does not finishes them at its own, lower, rate
    while the backlog grows. So completions in [t, t_end] over arrivals in [t - L, t_end - L] (L: the
    median latency of the middle third's arrivals; the shift keeps Poisson clumps at the window's edges
    from counting twice) estimates service rate / offered rate.
    Rejected: completed req/s over the whole run (its drain tail lowers it even when the server keeps
    up) and per-request latency growth (under continuous batching late arrivals slow early ones too).
    Probes must be long against the request latency (the `--probe-seconds` default: 60 s).

    Both windows start at least one L after the first request: when L exceeds a third of the probe,
    a completion window starting at the third would cover time no request could finish in, and the
    shifted arrival window would start before the first request; counts over those unequal windows
    once passed a server completing 3.5 req/s of 7.5 offered (L ~27 s).
    """
    ok = [r for r in results if r.ok]
    if len(ok) < 3:
        return 0.0
    t0, t1 = min(r.sent for r in results), max(r.sent for r in results)
    third = (t1 - t0) / 3
    middle = [r.latency for r in ok if t0 + third <= r.sent <= t0 + 2 * third]
    lag = statistics.median(middle) if middle else 0.0
    start = t0 + max(third, lag)
    if start >= t1:  # latency as long as the probe: it cannot show keeping up
        return 0.0
    arrivals = sum(1 for r in results if start - lag <= r.sent <= t1 - lag)
    completions = sum(1 for r in ok if start <= r.sent + r.latency <= t1)
    return completions / arrivals if arrivals else 0.0


def sustained(results: list[Result], min_ratio: float = 0.9) -> bool:
    """Whether the server kept up with the arrivals: every request completed, and its `service_ratio`
    is at least `min_ratio` (the 10% allows for Poisson noise in windows of a few dozen requests)."""
    return len(results) >= 3 and all(r.ok for r in results) and service_ratio(results) >= min_ratio
