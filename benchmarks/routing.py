"""Which replica a request goes to, and what it costs or saves: engines' prefix-cache hit rate, client TTFT
and the per-replica split of the work, for 2 model replicas under each routing.

Routings (`--configs`):
- haproxy: split_ingress=False; HAProxy (Ray 2.60's `leastconn`) in front of 2 OpenAIIngress replicas
  that each host an engine;
- pow2: `split_ingress`, one ingress in front of 2 LLMServer replicas, Serve's power-of-two router;
- prefix: the same with raytp's PrefixAwareRouter (raytp/serve/routing.py);
- serve-prefix: the same with Ray's PrefixCacheAffinityRouter, which keys on request text: it looks for an
  argument with a `.prompt` or `.messages` attribute, and raytp's `generate(EngineRequest)` (token ids) has
  neither (unmodified, every generate call raises ValueError inside Serve's routing task and
  the request is never routed). `TokenTextPrefixRouter` below feeds it the token ids as one character each
  (its private `_extract_text_from_request`), given the same load bound as raytp's router.

Workloads:
- multi-turn: `--conversations` chats, `--turns` each, all running at once (so their turns interleave); a
  turn resends the whole history (a shared system prompt, the chat's first message, every earlier answer
  and question) plus a new question, after a pause (`--think-s`, uniform around its mean). Without the
  pause a least-loaded router is sticky by accident: a turn arrives just as its previous turn frees a
  slot on the replica that served it, which then has the shorter queue (measured: pow2 then hit 61% of
  prompt tokens against 63% for the prefix router);
- skewed (`--skewed N`): N single-turn requests, `--hot` of them on one long shared document (a hot
  prefix) with their own question, the rest on documents of their own, `--concurrency` in flight.

Each routing gets a fresh Ray and app; the engine counters come from each replica's get_stats (a handle
cannot name a replica: calls other than generate reach a random one, so 40 calls see both).

    PYTHONPATH=. python -m benchmarks.routing [--conversations 16 --turns 3 --skewed 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest

from cluster.loop_records import LoopStats

APP = "raytp"
CONFIGS = ("haproxy", "pow2", "prefix", "serve-prefix")
WORDS = [
    *("river", "stone", "cloud", "garden", "engine", "lantern", "copper", "harbor", "violet", "meadow"),
    *("signal", "orbit", "pencil", "marble", "thunder", "velvet", "canyon", "ember", "falcon", "glacier"),
    *("hollow", "island", "jasmine", "kettle", "ladder", "mirror", "nectar", "oyster", "prairie", "quartz"),
    *("ribbon", "saddle", "timber", "umbrella", "valley", "willow", "yonder", "zephyr", "anchor", "basket"),
]


class TokenTextPrefixRouter(PrefixCacheAffinityRouter):
    """Ray's PrefixCacheAffinityRouter over raytp's generate argument: the prompt's token ids as text, one
    character per token id (ids below 0x110000 and outside the surrogates, as every vocabulary here)."""

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        return "".join(map(chr, pending_request.args[0].prompt_token_ids))  # the one EngineRequest


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def app_args(config: str, blocks: int) -> dict[str, Any]:
    engine = {"num_gpu_blocks_override": blocks, "max_model_len": 2048, "swap_space": 0.25}
    if config == "haproxy":  # 2 replicas run split by default: keep them behind HAProxy
        return {**engine, "num_replicas": 2, "split_ingress": False}
    return {
        **engine,
        "num_replicas": 2,
        "split_ingress": True,
        "request_router": "pow2" if config == "pow2" else "prefix",
    }


def build(config: str, blocks: int, threshold: int) -> Any:
    from raytp.serve.app import build_app

    if config != "serve-prefix":
        return build_app(app_args(config, blocks))
    options: dict[str, Any] = {
        "request_router_class": "benchmarks.routing.TokenTextPrefixRouter",
        "request_router_kwargs": {"imbalanced_threshold": threshold},
    }
    ray_router = RequestRouterConfig(**options)
    with mock.patch("raytp.serve.app.request_router_config", lambda name, block_size: ray_router):
        return build_app(app_args(config, blocks))


async def stream_ttft(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first content chunk, the answer's text)."""
    t0 = time.perf_counter()
    ttft: float | None = None
    text = []
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
    assert ttft is not None, "no content streamed"
    return ttft, "".join(text)


async def multi_turn(client: Any, model: str, args: argparse.Namespace) -> list[float]:
    system = "You are a patient assistant. " + words(random.Random(-1), args.system_words)

    async def conversation(i: int) -> list[float]:
        rng = random.Random(i)
        await asyncio.sleep(rng.random() * args.stagger_s)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": words(rng, args.first_words)}]
        ttfts = []
        for _ in range(args.turns):
            ttft, answer = await stream_ttft(client, model, messages, args.max_tokens)
            ttfts.append(ttft)
            await asyncio.sleep(rng.random() * 2 * args.think_s)
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": words(rng, args.turn_words)},
            ]
        return ttfts

    results = await asyncio.gather(*(conversation(i) for i in range(args.conversations)))
    return [t for r in results for t in r]


async def skewed(client: Any, model: str, args: argparse.Namespace) -> list[float]:
    rng = random.Random(7)
    hot_doc = words(random.Random(-2), args.doc_words)
    prompts = []
    for i in range(args.skewed):
        doc = hot_doc if i < args.hot * args.skewed else words(rng, args.doc_words)
        prompts.append(f"{doc}\n\nQuestion {i}: {words(rng, 12)}?")
    rng.shuffle(prompts)
    sem = asyncio.Semaphore(args.concurrency)

    async def one(prompt: str) -> float:
        async with sem:
            return (await stream_ttft(client, model, [{"role": "user", "content": prompt}], args.max_tokens))[0]

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def replica_stats(deployment: str) -> list[LoopStats]:
    from ray import serve

    handle = serve.get_deployment_handle(deployment, APP)
    seen: dict[tuple[int, ...], LoopStats] = {}
    for _ in range(40):
        st: LoopStats = handle.get_stats.remote().result(timeout_s=60)
        seen[(st.prompt_tokens_total, st.generation_tokens_total, st.prefix_cache_queries)] = st
    return sorted(seen.values(), key=lambda s: -s.prompt_tokens_total)


def run_config(config: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai
    import ray
    import requests
    from ray import serve

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        from raytp.serve.haproxy_env import free_port

        port = free_port("127.0.0.1")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(config, args.blocks, args.threshold), name=APP, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        model = requests.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900)
        t0 = time.perf_counter()
        ttfts = asyncio.run(
            multi_turn(client, model, args) if workload == "multi-turn" else skewed(client, model, args)
        )
        wall = time.perf_counter() - t0
        stats = replica_stats("OpenAIIngress" if config == "haproxy" else "LLMServer")
    finally:
        serve.shutdown()
        ray.shutdown()
    queries = sum(s.prefix_cache_queries for s in stats)
    hits = sum(s.prefix_cache_hits for s in stats)
    return {
        "config": config,
        "workload": workload,
        "requests": len(ttfts),
        "wall_s": wall,
        "hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens": queries,
        "computed_prompt_tokens": queries - hits,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
        # ignore_eos and a fixed max_tokens: a replica's generated tokens / max_tokens = its requests
        "requests_per_replica": [s.generation_tokens_total // args.max_tokens for s in stats],
        "hit_rate_per_replica": [round(s.prefix_cache_hit_rate, 3) for s in stats],
        "replicas_seen": len(stats),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--workloads", default="multi-turn,skewed")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=60)
    p.add_argument("--first-words", type=int, default=150)
    p.add_argument("--turn-words", type=int, default=30)
    p.add_argument("--stagger-s", type=float, default=2.0, help="conversations start within this window")
    p.add_argument("--think-s", type=float, default=2.0, help="mean pause between a chat's answer and its next turn")
    p.add_argument("--skewed", type=int, default=48, help="requests of the skewed workload")
    p.add_argument("--hot", type=float, default=0.8, help="share of the skewed requests on the hot document")
    p.add_argument("--doc-words", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=12, help="skewed workload: requests in flight")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--blocks", type=int, default=64, help="KV blocks per replica (128 tokens each on CPU)")
    p.add_argument("--threshold", type=int, default=8, help="serve-prefix's imbalanced_threshold (raytp's default)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run, its result on stdout
    args = p.parse_args()
    if args.child:
        return run_child(args)
    results = []
    for workload in args.workloads.split(","):
        for config in args.configs.split(","):
            # Each routing in a process (and Ray) of its own: a Ray restarted in one process on a loaded
            # 2-core machine timed out starting its node.
            argv = [a for a in sys.argv[1:] if a != "--child"]
            cmd = [sys.executable, "-m", "benchmarks.routing", *argv, "--child"]
            cmd += ["--configs", config, "--workloads", workload]
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            results.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'workload':<11} {'routing':<13} {'hit rate':>8} {'computed':>9} {'TTFT p50':>9} {'p99':>8}  per replica")
    for r in results:
        print(
            f"{r['workload']:<11} {r['config']:<13} {r['hit_rate']:>8.1%} {r['computed_prompt_tokens']:>9} "
            f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>6.0f}ms  {r['requests_per_replica']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def run_child(args: argparse.Namespace) -> None:
    from raytp.serve.args import use_serve_defaults
    from raytp.serve.haproxy_env import release, use_private_haproxy

    logging.getLogger("httpx").setLevel(logging.WARNING)
    haproxy_dir = use_private_haproxy("127.0.0.1")
    use_serve_defaults()
    try:
        result = run_config(args.configs, args.workloads, args)
    finally:
        release(haproxy_dir)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
