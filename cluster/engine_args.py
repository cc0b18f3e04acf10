"""CLI flags for EngineConfig, named like vLLM's so `vllm` command lines carry over."""

from __future__ import annotations

import argparse
from typing import Any

from cluster.config import PLACEMENT_STRATEGIES, EngineConfig
from ops.attention.names import ATTENTION_BACKENDS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--seed", type=int, default=0, help="seed of the engine RNG (draws per-request seeds)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--preemption-mode", default="auto", choices=["auto", "recompute", "swap"])
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument(
        "--swap-space", type=float, default=4.0, help="GiB of CPU memory for swapped-out KV blocks"
    )
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="CPU KV cache budget in bytes")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--distributed-executor-backend", default=None, choices=["ray", "inprocess"])
    g.add_argument(
        "--placement-strategy",
        default="PACK",
        choices=list(PLACEMENT_STRATEGIES),
        help="Ray placement group strategy for the tensor-parallel workers",
    )
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS))
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--revision", default=None)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields: dict[str, Any] = {
        name: getattr(args, name) for name in EngineConfig.__dataclass_fields__ if hasattr(args, name)
    }
    return EngineConfig(**fields)
