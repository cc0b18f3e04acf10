"""The controller's metrics on the Ray node's metrics port: per-rank step times of a TP=2 engine, the
failed rank's counter and the health gauge when a rank dies, and nothing at all with
disable_log_stats. Tiny random-weight model; no Prometheus needed (the node's page is read)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import EngineConfig
from cluster.controller import EngineController
from cluster.metrics.endpoint import collect, node_metrics_urls
from request.sampling_params import SamplingParams
from tests.helpers.tiny_models import make_tiny_llama
from tests.metrics.conftest import EXPORT_INTERVAL_MS

KV_BYTES = 1 << 24
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(Path(tmp_path_factory.mktemp("models")))


def _samples(replica: str) -> dict[tuple[str, str], float]:
    """(sample name, rank label or "") -> value, for one replica's raytp series on the node's page."""
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(collect(node_metrics_urls(), prefixes=("ray_raytp_",))):
        for s in fam.samples:
            if s.labels.get("replica") == replica and "le" not in s.labels:
                out[(s.name, s.labels.get("rank", ""))] = s.value
    return out


def _wait(replica: str, cond: Callable[[dict[tuple[str, str], float]], bool], what: str) -> dict[Any, float]:
    deadline = time.monotonic() + 30
    while not cond(got := _samples(replica)):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {got}")
        time.sleep(0.5)
    return got


def _generate(controller: Any, rid: str, max_tokens: int) -> int:
    async def run() -> int:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        gen = controller.generate.options(num_returns="streaming").remote(rid, PROMPT, params)
        return sum(len(s.token_ids) for d in [await ref async for ref in gen] for s in d.samples)

    return asyncio.run(run())


def test_rank_step_times_failure_counter_and_health(model: str, ray_metrics_port: int) -> None:
    config = EngineConfig(model=model, kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2)
    controller = EngineController.remote(config, replica="tp2")  # type: ignore[attr-defined]
    try:
        tokens = _generate(controller, "a", 8)
        # Both ranks run every step, so once the request is done they have recorded the same number of
        # steps. Each rank exports on its own clock, so a scrape may still see one a step behind: the
        # equality is waited for (and the wait fails if it never comes).
        got = _wait(
            "tp2",
            lambda s: (
                s.get(("ray_raytp_generation_tokens_total", "")) == tokens
                and s.get(("ray_raytp_worker_step_time_seconds_count", "0"), 0) > 0
                and s.get(("ray_raytp_worker_step_time_seconds_count", "0"))
                == s.get(("ray_raytp_worker_step_time_seconds_count", "1"))
            ),
            "the first request's metrics, the same step count on both ranks",
        )
        assert got[("ray_raytp_engine_healthy", "")] == 1.0
        assert got[("ray_raytp_model_config_info", "")] == 1.0  # set at start (its labels: tests/cluster)
        assert got[("ray_raytp_worker_failures_total", "1")] == 0.0  # exists at 0 before any failure

        ranks = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("-rank1")]
        assert len(ranks) == 1, ranks
        ray.kill(ray.get_actor(ranks[0]["name"], namespace=ranks[0]["namespace"]))
        with pytest.raises(Exception, match="the engine is dead"):
            for _ in range(100):  # the health check notices the dead rank (no request needed)
                ray.get(controller.check_health.remote())
                time.sleep(0.2)
        got = _wait(
            "tp2", lambda s: s.get(("ray_raytp_worker_failures_total", "1")) == 1.0, "the failed rank's counter"
        )
        assert got[("ray_raytp_worker_failures_total", "0")] == 0.0
        assert _wait("tp2", lambda s: s.get(("ray_raytp_engine_healthy", "")) == 0.0, "health 0")
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)


def test_disable_log_stats_records_nothing(model: str, ray_metrics_port: int) -> None:
    config = EngineConfig(model=model, disable_log_stats=True, kv_cache_memory_bytes=KV_BYTES)
    controller = EngineController.remote(config, replica="quiet")  # type: ignore[attr-defined]
    try:
        assert _generate(controller, "b", 4) == 4
        time.sleep(3 * EXPORT_INTERVAL_MS / 1000)  # anything recorded would be on the page by now
        assert _samples("quiet") == {}
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
