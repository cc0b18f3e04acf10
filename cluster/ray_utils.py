"""Reaching Ray: join the cluster the user already has, or start a local one.

Order (decision): a process that already called `ray.init` keeps its session (tests,
notebooks, Ray Serve replicas, `ray job submit` drivers); otherwise `RAY_ADDRESS`
names the cluster to join; otherwise a fresh local Ray instance starts, sized by Ray
from this machine's CPUs, GPUs and memory.

The local instance starts without Ray's dashboard head unless `RAYTP_RAY_DASHBOARD=1` (decision).
In Ray 2.60 the head runs ~10 module processes (~1 GiB RSS in all) whose periodic wake-ups preempt
a model worker's compute threads: on a 2-core machine, `benchmarks/serving_profile.py --request-rate 1
--num-prompts 32` took 44.1-44.7 s with it and 37.9-39.9 s without (worker step 246-261 -> 217-219 ms).
Nothing raytp runs needs it: metrics leave through each node's dashboard *agent*, which still runs.
Clusters started elsewhere (`ray start --head`, KubeRay) keep theirs: Ray Jobs and `serve deploy`
talk to it.
"""

from __future__ import annotations

import logging
import os

import ray

logger = logging.getLogger(__name__)


def ensure_ray() -> None:
    """Make sure this process is connected to a Ray cluster."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("joining the Ray cluster at RAY_ADDRESS=%s", address)
        ray.init(address=address)
    else:
        logger.info("no Ray cluster given (RAY_ADDRESS unset): starting a local one")
        ray.init(address="local", include_dashboard=os.environ.get("RAYTP_RAY_DASHBOARD", "0") == "1")
