"""Shared pieces of the Ray executor / controller tests: a Ray session per module, leak checks, references."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

from raytp import LLM, SamplingParams

# Every rank actor is named "<placement group name>-rank<r>", and every group "raytp-<hex>" (a batch pass's
# engines: "raytp-batch-<pass>-<engine>").
RAYTP_PREFIX = "raytp-"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """One local Ray per test module, with 4 fake CPUs so TP=3 fits on a 2-core machine."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def tiny_prompts(n: int = 8) -> list[list[int]]:
    """Token ids of different lengths (3..60) within the tiny models' byte vocabulary."""
    return [[(7 * i + 13 * j) % 250 + 3 for j in range(3 + 8 * i)] for i in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate_ids(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks, "KV blocks leaked"
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks, "CPU swap blocks leaked"


def live_placement_groups() -> set[str]:
    """Ids of placement groups that hold or wait for resources (anything not REMOVED)."""
    return {pg_id for pg_id, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


def live_rank_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(RAYTP_PREFIX)]


def rank_actor(name_suffix: str) -> Any:
    """The live rank actor whose name ends with `name_suffix` (e.g. "-rank1"); exactly one must exist."""
    found = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one live actor named *{name_suffix}, found {found}"
    return ray.get_actor(found[0]["name"], namespace=found[0]["namespace"])


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def assert_nothing_left(pgs_before: set[str]) -> None:
    """No placement group from the attempt is alive and no rank actor survives (actor death takes a moment)."""
    assert live_placement_groups() <= pgs_before, "a placement group was left behind"
    wait_until(lambda: not live_rank_actors(), 10, f"rank actors to die: {live_rank_actors()}")
