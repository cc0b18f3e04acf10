"""Placement groups for tensor-parallel workers: one bundle per rank, reserved atomically.

A bundle is `{"GPU": 1, "CPU": c}` on CUDA clusters and `{"CPU": c}` otherwise. The
strategy is PACK by default (ranks share nodes: collectives stay on fast local links),
SPREAD / STRICT_SPREAD to put ranks on different nodes, STRICT_PACK for one node.

Failure policy (decision): a request the cluster can never satisfy is refused before a
placement group exists, with the numbers that show why; one it could satisfy but not
now (other actors hold the resources) waits at most `timeout_s`, after which the
pending group is removed so nothing is left reserved or queued. The up-front check
looks at the nodes alive now, so an autoscaling cluster must be scaled up first.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, remove_placement_group

from cluster.env import env_float

Bundle = dict[str, float]


class PlacementError(ValueError):
    """The cluster cannot place the requested workers (a configuration error, not a crash)."""


def cpus_per_worker() -> float:
    """The CPUs each rank reserves (RAYTP_CPUS_PER_WORKER, default 1) and, on the CPU, its torch threads: a Ray
    rank's bundle, or a Serve replica that runs its model in its own process."""
    return env_float("RAYTP_CPUS_PER_WORKER", 1.0)


def worker_bundle(use_gpu: bool, cpus_per_worker: float) -> Bundle:
    return {"GPU": 1.0, "CPU": cpus_per_worker} if use_gpu else {"CPU": cpus_per_worker}


def new_group_name() -> str:
    """A unique name; the rank actors are named after their group, so both are easy to find."""
    return f"raytp-{uuid.uuid4().hex[:8]}"


def create_placement_group(bundle: Bundle, count: int, strategy: str, timeout_s: float, name: str) -> PlacementGroup:
    """Reserve `count` copies of `bundle`; returns a ready group or raises PlacementError (nothing left behind)."""
    check_feasible(bundle, count, strategy)
    pg = placement_group([dict(bundle) for _ in range(count)], strategy=strategy, name=name)
    try:
        ready = pg.wait(timeout_seconds=timeout_s)
    except BaseException:
        remove_placement_group(pg)
        raise
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"could not reserve {count} bundles of {_fmt(bundle)} ({strategy}) within {timeout_s:g} s: "
            f"{_free_summary(bundle)}; other actors or placement groups hold the rest. Free them, add nodes, "
            f"or raise RAYTP_PLACEMENT_TIMEOUT_S."
        )
    return pg


def remove_groups_named(prefix: str) -> list[str]:
    """Remove every placement group of this namespace whose name starts with `prefix` and that is not removed
    yet (the actors in it die with it); returns their names. For groups whose creator died without freeing them:
    a group belongs to the job, so it outlives the actor that made it."""
    names = sorted(
        info["name"]
        for info in ray.util.placement_group_table().values()
        if info["name"].startswith(prefix) and info["state"] != "REMOVED"
    )
    for name in names:
        with contextlib.suppress(ValueError):  # removed meanwhile
            remove_placement_group(get_placement_group(name))
    return names


def check_feasible(bundle: Bundle, count: int, strategy: str) -> None:
    """Raise PlacementError unless the alive nodes' total resources could ever hold the group."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fits = [_bundles_fitting(res, bundle) for res in nodes]
    cluster = _total_summary(bundle, nodes)
    if strategy == "STRICT_PACK":
        ok = max(fits, default=0) >= count
        why = f" on one node, but no node of the cluster ({cluster}) holds more than {max(fits, default=0)}"
    elif strategy == "STRICT_SPREAD":
        ok = sum(1 for f in fits if f >= 1) >= count
        why = (
            f" on {count} different nodes, but the cluster ({cluster}) has {sum(1 for f in fits if f >= 1)} such nodes"
        )
    else:
        ok = sum(fits) >= count
        why = f", but the cluster ({cluster}) can hold only {sum(fits)}"
    if not ok:
        raise PlacementError(f"tensor_parallel_size={count} needs {count} bundles of {_fmt(bundle)} ({strategy}){why}.")


def _bundles_fitting(resources: dict[str, Any], bundle: Bundle) -> int:
    counts = [math.floor(float(resources.get(k, 0.0)) / v + 1e-9) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 0


def _total_summary(bundle: Bundle, nodes: list[dict[str, Any]]) -> str:
    parts = []
    for key in bundle:
        total = sum(float(res.get(key, 0.0)) for res in nodes)
        parts.append(f"{total:g} {key}{'s' if total != 1 else ''}")
    return f"{' and '.join(parts)} on {len(nodes)} node{'s' if len(nodes) != 1 else ''}"


def _free_summary(bundle: Bundle) -> str:
    total, free = ray.cluster_resources(), ray.available_resources()
    parts = [f"{float(free.get(k, 0.0)):g} of {float(total.get(k, 0.0)):g} {k} free" for k in bundle]
    return "the cluster has " + " and ".join(parts)


def _fmt(bundle: Bundle) -> str:
    return "{" + ", ".join(f"'{k}': {v:g}" for k, v in bundle.items()) + "}"
