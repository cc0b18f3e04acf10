"""The controller side of LoRA without workers: the engine, the serving loop and `LLM` over a fake executor that
records what reaches the ranks. Adapter checks before any rank is touched, errors that name the adapter, the
engine serving on after each, load on first use, removal refused while in use, and no KV block leaked."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import cluster.controller
import raytp.llm
from cluster.config import EngineConfig, ResolvedEngineConfig
from cluster.controller import EngineLoop
from cluster.engine import EngineDeadError, LLMEngine
from cluster.executor import Executor, check_rank_method
from model_exec.config import ModelConfig
from raytp import LLM, LoRAError, LoRARequest, SamplingParams
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput, SeqSample
from tests.helpers.tiny_models import make_tiny_llama

PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks of 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class FakeExecutor(Executor):
    """One rank that holds adapters by id and answers every sample with token 7 + the sequence's adapter id.
    `collective_rpc` calls the Worker method of that name on this fake rank (its methods below)."""

    def __init__(self, config: ResolvedEngineConfig, model_config: ModelConfig) -> None:
        self.loaded: dict[int, LoRARequest] = {}
        self.loads: list[tuple[str, str]] = []  # (adapter name, thread that loaded it)
        self.seq_lora: dict[int, int] = {}
        self.step_loras: list[set[int]] = []
        self.fail_next_load: Exception | None = None
        self.load_seconds = 0.0

    def collective_rpc(
        self, method: str, *args: Any, ranks: Any = None, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        check_rank_method(method)
        return [getattr(self, method)(*args, **kwargs)]

    def determine_num_blocks(self) -> tuple[int, int]:
        return 64, 16

    def quantization(self) -> str:
        return "none"  # no weights at all

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for new in so.new_seqs:
            assert new.lora_id == 0 or new.lora_id in self.loaded, "a step named an adapter the ranks lack"
            self.seq_lora[new.seq_id] = new.lora_id
        rows = [s.seq_id for s in so.new_seqs] + [s.seq_id for s in so.cached_seqs]
        self.step_loras.append({self.seq_lora[r] for r in rows} - {0})
        return ModelRunnerOutput(
            samples={
                seq_id: SeqSample([7 + self.seq_lora[seq_id]] * n, [0.0] * n) for seq_id, n in so.num_samples.items()
            }
        )

    def add_lora(self, lora: LoRARequest) -> None:
        if self.fail_next_load is not None:
            error, self.fail_next_load = self.fail_next_load, None
            raise error
        time.sleep(self.load_seconds)
        self.loads.append((lora.lora_name, threading.current_thread().name))
        self.loaded[lora.lora_int_id] = lora

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.loaded.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[int]:
        return sorted(self.loaded)

    def start_metrics(self, model_name: str, replica: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


def write_adapter(path: Path, rank: int = 8) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(b"")  # the controller reads the config only
    return str(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("models"))


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, LoRARequest]:
    return {
        "sql": LoRARequest("sql", 1, write_adapter(tmp_path / "sql")),
        "chat": LoRARequest("chat", 2, write_adapter(tmp_path / "chat", rank=4)),
        "big": LoRARequest("big", 3, write_adapter(tmp_path / "big", rank=32)),
        "missing": LoRARequest("missing", 4, str(tmp_path / "nowhere")),
    }


def make_engine(model: str, **kwargs: Any) -> LLMEngine:
    config = EngineConfig(model=model, block_size=4, **{"enable_lora": True, "max_loras": 2, **kwargs})
    return LLMEngine(config, executor_factory=FakeExecutor)


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(t for s in delta.samples for t in s.token_ids)
    return tokens


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks


def fake(engine: LLMEngine) -> FakeExecutor:
    assert isinstance(engine.executor, FakeExecutor)
    return engine.executor


def test_lora_refused_when_not_enabled(model: str, adapters: dict[str, LoRARequest]) -> None:
    engine = make_engine(model, enable_lora=False)
    with pytest.raises(LoRAError, match=r"LoRA is not enabled \(start with enable_lora / --enable-lora\)"):
        engine.add_lora(adapters["sql"])
    with pytest.raises(LoRAError, match="not enabled") as info:
        engine.add_request("r", PROMPT, GREEDY, lora_request=adapters["sql"])
    assert info.value.param == "lora_request"
    engine.add_request("base", PROMPT, GREEDY)
    assert run_all(engine) == {"base": [7] * 6}
    assert not fake(engine).loads
    assert_no_leak(engine)


def test_add_list_and_conflicts(model: str, adapters: dict[str, LoRARequest], tmp_path: Path) -> None:
    engine = make_engine(model)
    sql = adapters["sql"]
    assert engine.add_lora(sql) is True
    assert engine.add_lora(LoRARequest("sql", 1, sql.lora_path)) is False  # the same adapter: nothing to do
    assert engine.list_loras() == [sql]
    other = LoRARequest("other", 1, write_adapter(tmp_path / "other"))
    with pytest.raises(LoRAError, match=r"lora_int_id 1 already names LoRA adapter 'sql'.*'other'"):
        engine.add_lora(other)
    with pytest.raises(LoRAError, match="lora_int_id 1 already names"):
        engine.add_request("r", PROMPT, GREEDY, lora_request=other)
    with pytest.raises(LoRAError, match="name 'sql' is already loaded with lora_int_id 1"):
        engine.add_lora(LoRARequest("sql", 9, sql.lora_path))
    assert [name for name, _ in fake(engine).loads] == ["sql"]
    assert fake(engine).list_loras() == [1]


def test_bad_adapters_are_refused_before_any_rank_and_the_engine_serves_on(
    model: str, adapters: dict[str, LoRARequest]
) -> None:
    engine = make_engine(model)
    with pytest.raises(LoRAError, match=r"'missing' at '.*nowhere'.*adapter_config\.json"):
        engine.add_lora(adapters["missing"])
    with pytest.raises(LoRAError, match=r"'big'.*rank 32 is over max_lora_rank=16") as info:
        engine.add_request("r", PROMPT, GREEDY, lora_request=adapters["big"])
    assert info.value.code == "lora_rank_exceeded"
    assert not fake(engine).loads  # refused before any rank was touched
    fake(engine).fail_next_load = LoRAError("LoRA adapter 'sql': no weights for q_proj")
    with pytest.raises(LoRAError, match="no weights for q_proj"):
        engine.add_lora(adapters["sql"])
    assert engine.list_loras() == [] and engine.dead is None
    engine.add_request("base", PROMPT, GREEDY)
    engine.add_request("sql", PROMPT, GREEDY, lora_request=adapters["sql"])  # loads on first use now
    assert run_all(engine) == {"base": [7] * 6, "sql": [8] * 6}
    assert_no_leak(engine)


def test_a_rank_failing_a_load_is_an_engine_failure(model: str, adapters: dict[str, LoRARequest]) -> None:
    engine = make_engine(model)
    engine.add_request("base", PROMPT, GREEDY)
    fake(engine).fail_next_load = RuntimeError("tensor-parallel rank 1 of 2 failed during the load")
    with pytest.raises(RuntimeError, match="rank 1"):
        engine.add_lora(adapters["sql"])
    assert engine.dead is not None
    deltas = engine.collect_finished()
    assert [d.request_id for d in deltas] == ["base"] and deltas[0].finished
    with pytest.raises(EngineDeadError):
        engine.add_lora(adapters["chat"])
    assert_no_leak(engine)


def test_remove_refused_while_in_use_then_allowed(model: str, adapters: dict[str, LoRARequest]) -> None:
    engine = make_engine(model)
    sql = adapters["sql"]
    for i in range(3):
        engine.add_request(f"r{i}", PROMPT, GREEDY, lora_request=sql)
    engine.step()
    with pytest.raises(LoRAError, match=r"'sql' \(lora_int_id 1\) is in use by 3 unfinished requests") as info:
        engine.remove_lora(1)
    assert info.value.code == "lora_in_use"
    engine.abort_request("r0")
    with pytest.raises(LoRAError, match="in use by 2 unfinished requests"):
        engine.remove_lora(1)
    run_all(engine)
    assert engine.remove_lora(1) is True
    assert engine.remove_lora(1) is False
    assert engine.list_loras() == [] and fake(engine).loaded == {}
    assert_no_leak(engine)


def test_reloaded_id_never_hits_the_blocks_of_the_adapter_it_named_before(
    model: str, adapters: dict[str, LoRARequest], tmp_path: Path
) -> None:
    engine = make_engine(model, enable_prefix_caching=True)
    sql = adapters["sql"]
    engine.add_request("a", PROMPT, GREEDY, lora_request=sql)
    run_all(engine)
    hit = engine.add_request("c", PROMPT, GREEDY, lora_request=sql)
    base = engine.add_request("d", PROMPT, GREEDY)
    run_all(engine)
    assert hit.num_cached_tokens == 20 and base.num_cached_tokens == 0
    assert engine.remove_lora(1)
    reused = LoRARequest("sql-v2", 1, write_adapter(tmp_path / "sql-v2"))
    fresh = engine.add_request("e", PROMPT, GREEDY, lora_request=reused)
    again = engine.add_request("f", PROMPT, GREEDY)  # the base model finds its own blocks
    run_all(engine)
    assert fresh.num_cached_tokens == 0 and again.num_cached_tokens == 20
    assert_no_leak(engine)


def test_max_loras_bounds_every_step(model: str, adapters: dict[str, LoRARequest], tmp_path: Path) -> None:
    engine = make_engine(model, max_loras=1)
    loras = [adapters["sql"], adapters["chat"], None]
    for i in range(9):
        engine.add_request(f"r{i}", PROMPT, GREEDY, lora_request=loras[i % 3])
    tokens = run_all(engine)
    token_of = {0: 8, 1: 9, 2: 7}  # 7 + the adapter id
    assert all(tokens[f"r{i}"] == [token_of[i % 3]] * 6 for i in range(9))
    assert max(len(s) for s in fake(engine).step_loras) == 1
    assert {frozenset(s) for s in fake(engine).step_loras} >= {frozenset({1}), frozenset({2})}
    assert_no_leak(engine)


def test_offline_llm_takes_one_adapter_or_one_per_prompt(
    model: str, adapters: dict[str, LoRARequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(raytp.llm, "LLMEngine", functools.partial(LLMEngine, executor_factory=FakeExecutor))
    llm = LLM(model, block_size=4, enable_lora=True, max_loras=2)
    outs = llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=adapters["chat"])
    assert [o.outputs[0].token_ids for o in outs] == [[9] * 6, [9] * 6]
    outs = llm.generate([PROMPT] * 3, GREEDY, use_tqdm=False, lora_request=[adapters["sql"], None, adapters["chat"]])
    assert [o.outputs[0].token_ids for o in outs] == [[8] * 6, [7] * 6, [9] * 6]
    with pytest.raises(ValueError, match="one LoRARequest or one per prompt: got 1 for 2 prompts"):
        llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[adapters["sql"]])
    with pytest.raises(LoRAError, match="'big'"):
        llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[adapters["sql"], adapters["big"]])
    chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, lora_request=adapters["sql"])
    assert chat[0].outputs[0].token_ids == [8] * 6
    assert [a.lora_name for a in llm.list_loras()] == ["sql", "chat"]
    assert_no_leak(llm.llm_engine)


def test_engine_loop_loads_on_its_step_thread(
    model: str, adapters: dict[str, LoRARequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster.controller, "LLMEngine", functools.partial(LLMEngine, executor_factory=FakeExecutor))
    loop = EngineLoop(EngineConfig(model=model, block_size=4, enable_lora=True, max_loras=2, disable_log_stats=True))
    ex = fake(loop.engine)

    async def collect(rid: str, lora: LoRARequest | None) -> list[int]:
        return [t async for d in loop.generate(rid, PROMPT, GREEDY, lora) for s in d.samples for t in s.token_ids]

    async def scenario() -> None:
        info = await loop.model_info()
        assert (info.enable_lora, info.max_loras, info.max_lora_rank) == (True, 2, 16)
        with pytest.raises(LoRAError, match="rank 32 is over max_lora_rank"):
            await loop.add_lora(adapters["big"])
        with pytest.raises(LoRAError, match="'missing'"):
            await collect("bad", adapters["missing"])
        # two requests for a new adapter at once: one load, on the step thread
        a, b, base = await asyncio.gather(
            collect("a", adapters["sql"]), collect("b", adapters["sql"]), collect("base", None)
        )
        assert (a, b, base) == ([8] * 6, [8] * 6, [7] * 6)
        assert len(ex.loads) == 1 and ex.loads[0][1].startswith("raytp-step")
        assert await loop.add_lora(adapters["sql"]) is False
        assert await loop.add_lora(adapters["chat"]) is True
        assert [a.lora_int_id for a in await loop.list_loras()] == [1, 2]
        stream = loop.generate("long", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), adapters["chat"])
        await stream.__anext__()
        with pytest.raises(LoRAError, match=r"'chat' \(lora_int_id 2\) is in use by 1 unfinished request"):
            await loop.remove_lora(2)
        await stream.aclose()  # aborts it
        assert await loop.remove_lora(2) is True
        assert await loop.remove_lora(2) is False
        assert list(ex.loaded) == [1]
        # a caller that goes away mid-load does not cut the load between the ranks and the registry
        ex.load_seconds = 0.3
        waiting = asyncio.get_running_loop().create_task(collect("gone", adapters["chat"]))
        await asyncio.sleep(0.1)
        waiting.cancel()
        assert await loop.add_lora(adapters["chat"]) is False  # waited for the load in flight
        assert list(ex.loaded) == [1, 2] and [a.lora_int_id for a in await loop.list_loras()] == [1, 2]
        stats = await loop.get_stats()
        assert stats.num_free_device_blocks == stats.num_device_blocks
        await loop.shutdown()

    asyncio.run(scenario())


def test_lora_requests_info(model: str, adapters: dict[str, LoRARequest], monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.engine_stats import EngineStatsCollector
    from cluster.metrics import ray_metrics
    from cluster.metrics.stats import LoRAStats

    engine = make_engine(model, max_loras=1)
    collector = EngineStatsCollector(engine.scheduler, engine.block_manager, engine.loras)
    engine.add_request("a", PROMPT, GREEDY, lora_request=adapters["sql"])
    engine.add_request("b", PROMPT, GREEDY, lora_request=adapters["chat"])
    engine.add_request("c", PROMPT, GREEDY)
    engine.step()
    assert collector.scheduler_stats().lora == LoRAStats(("sql",), ("chat",), 1)
    run_all(engine)
    assert collector.scheduler_stats().lora == LoRAStats((), (), 1)
    off = make_engine(model, enable_lora=False)
    assert EngineStatsCollector(off.scheduler, off.block_manager, off.loras).scheduler_stats().lora is None

    class Keeper:
        def __init__(self) -> None:
            self.live: dict[frozenset[tuple[str, str]], float] = {}

        def set(self, d: Any, tags: dict[str, str], value: float) -> None:
            if d.name == "raytp:lora_requests_info":
                self.live[frozenset(tags.items())] = value

        def forget(self, tags: dict[str, str]) -> None:
            self.live = {k: v for k, v in self.live.items() if not set(tags.items()) <= k}

    keeper = Keeper()
    monkeypatch.setattr(ray_metrics, "_keeper", keeper)
    monkeypatch.setattr(ray_metrics, "_count", lambda *args: None)
    monkeypatch.setattr(ray_metrics, "_zero", lambda *args: None)
    recorder = ray_metrics.EngineMetrics("m", "r0")
    stats = collector.scheduler_stats()
    recorder.record_scheduler_stats(dataclasses.replace(stats, lora=LoRAStats(("sql",), ("chat", "x"), 1)))
    recorder.record_scheduler_stats(dataclasses.replace(stats, lora=LoRAStats(("chat",), (), 1)))
    (labels,) = keeper.live  # the previous label set is no longer refreshed
    assert dict(labels) == {
        "model_name": "m",
        "replica": "r0",
        "running_lora_adapters": "chat",
        "waiting_lora_adapters": "",
        "max_lora": "1",
    }
