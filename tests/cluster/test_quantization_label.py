"""Which quantization runs, as the engine knows it (issue 39 item 4): asked of every rank at start, refused when
ranks disagree, carried by ModelInfo to `/v1/models`, and recorded as `raytp:model_config_info`.

In-process tiny Llama engines (milliseconds to load); the int8 one needs the C++ kernels' AVX2 build.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.config import EngineConfig, ResolvedEngineConfig
from cluster.controller import EngineLoop
from cluster.engine import LLMEngine
from cluster.executor import Executor, check_rank_method
from model_exec.config import ModelConfig
from model_exec.layers.quantization.gguf import kernels_available
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from tests.helpers.tiny_models import make_tiny_llama

KV_BYTES = 1 << 22


@pytest.fixture(autouse=True)
def _no_ray_left_up() -> Any:
    """EngineLoop's runtime context and Ray's metric instruments start a local Ray on first use: each test here
    stops it, so a later test in the same process finds none (naming ray also puts this file in the suite's
    "live" group with the other tests that start one, tests/conftest.py)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(Path(tmp_path_factory.mktemp("models")))


def _info(config: EngineConfig) -> Any:
    loop = EngineLoop(config)

    async def run() -> Any:
        try:
            return await loop.model_info()
        finally:
            await loop.shutdown()

    return asyncio.run(run())


def test_a_float_engine_runs_none(model: str) -> None:
    info = _info(EngineConfig(model=model, kv_cache_memory_bytes=KV_BYTES, disable_log_stats=True))
    assert (info.quantization, info.dtype) == ("none", "float32")


@pytest.mark.skipif(not kernels_available(), reason="int8 runs on the C++ kernels' AVX2 build")
def test_an_int8_engine_runs_int8(model: str) -> None:
    config = EngineConfig(model=model, kv_cache_memory_bytes=KV_BYTES, quantization="int8", disable_log_stats=True)
    info = _info(config)
    assert (info.quantization, info.dtype) == ("int8", "float32")


class _Ranks(Executor):
    """Two fake ranks that loaded the weights with the quantizations given."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.closed = False

    def collective_rpc(
        self, method: str, *args: Any, ranks: Any = None, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        check_rank_method(method)
        if method == "quantization":
            return list(self.answers)
        if method == "determine_num_blocks":
            return [(16, 0)] * len(self.answers)
        return [None] * len(self.answers)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        raise AssertionError("no step runs")

    def shutdown(self) -> None:
        self.closed = True


def test_ranks_that_disagree_are_refused_by_name(model: str) -> None:
    made: list[_Ranks] = []

    def factory(answers: list[str]) -> Any:
        def make(config: ResolvedEngineConfig, model_config: ModelConfig) -> Executor:
            made.append(_Ranks(answers))
            return made[-1]

        return make

    with pytest.raises(RuntimeError, match=r"different quantizations \(rank 0: int8, rank 1: none\)"):
        LLMEngine(EngineConfig(model=model), executor_factory=factory(["int8", "none"]))
    assert made[-1].closed, "the refused engine's ranks are shut down"
    engine = LLMEngine(EngineConfig(model=model), executor_factory=factory(["int8", "int8"]))
    assert engine.quantization == "int8" and not made[-1].closed


def test_the_info_gauge_is_set_at_start_and_dropped_at_close(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.engine_telemetry import EngineTelemetry
    from cluster.metrics import ray_metrics

    class Keeper:  # the recorder's gauge keeper, without Ray: what is live, with which labels
        def __init__(self) -> None:
            self.live: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}

        def set(self, d: Any, tags: dict[str, str], value: float) -> None:
            self.live[(d.name, frozenset(tags.items()))] = value

        def forget(self, tags: dict[str, str]) -> None:
            self.live = {k: v for k, v in self.live.items() if not set(tags.items()) <= k[1]}

    keeper = Keeper()
    monkeypatch.setattr(ray_metrics, "_keeper", keeper)
    for name in ("_count", "_zero", "_observe"):
        monkeypatch.setattr(ray_metrics, name, lambda *args: None)
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory_bytes=KV_BYTES))
    try:
        telemetry = EngineTelemetry(engine, "r0", "m")
        info = {dict(tags)["quantization"]: (dict(tags), v) for (n, tags), v in keeper.live.items() if "info" in n}
        assert info == {"none": ({"model_name": "m", "replica": "r0", "quantization": "none", "dtype": "float32"}, 1.0)}
        telemetry.close()
        assert not keeper.live
        recorder = ray_metrics.EngineMetrics("m", "r1")
        with pytest.raises(ValueError, match="model_config_info is not an engine info gauge"):
            recorder.record_info("model_config_info", {"quantization": "none"})  # a label missing
        with pytest.raises(ValueError, match="engine_healthy is not an engine info gauge"):
            recorder.record_info("engine_healthy", {})  # no labels of its own: not an info gauge
    finally:
        engine.shutdown()
