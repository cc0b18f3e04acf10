"""LoRA end to end: raytp's greedy output with a PEFT adapter equals HF with the adapter merged
(peft merge_and_unload), token for token, at TP 1 in-process and TP 2 over Ray workers; a batch mixing two
adapters and the base model gives each row what it gets alone; bad adapters are LoRAErrors naming them (from
the controller's config check and from the ranks' weight check, across Ray), and the engine serves on
without leaking a KV block."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from cluster.config import EngineConfig
from cluster.controller import EngineController
from cluster.outputs import RequestDelta
from cluster.ray_executor import RankFailedError
from raytp import LLM, LoRAError, LoRARequest, SamplingParams
from tests.cluster.ray_helpers import ray_session  # noqa: F401 - the fixture
from tests.helpers.family_parity import ENGINE_KWARGS, ENGINE_PROMPTS, hf_model
from tests.helpers.hf_reference import hf_greedy_generate
from tests.helpers.lora_models import hf_merged_model, make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama

MAX_NEW = 24
LORA_KWARGS: dict[str, Any] = dict(ENGINE_KWARGS, enable_lora=True, max_loras=2, max_lora_rank=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def model(root: Path) -> str:
    return make_tiny_llama(root)


@pytest.fixture(scope="module")
def adapters(model: str, root: Path) -> dict[str, LoRARequest]:
    wrong_shape = make_tiny_llama(root / "other", intermediate_size=96)  # its MLP adapter cannot fit `model`
    return {
        "sql": LoRARequest("sql", 1, make_peft_adapter(model, root / "sql", rank=8, seed=1)),
        "chat": LoRARequest(
            "chat", 2, make_peft_adapter(model, root / "chat", rank=4, seed=2, targets=("q_proj", "v_proj", "up_proj"))
        ),
        "big": LoRARequest("big", 3, make_peft_adapter(model, root / "big", rank=32, seed=3)),
        "missing": LoRARequest("missing", 4, str(root / "no-such-adapter")),
        "misfit": LoRARequest("misfit", 5, make_peft_adapter(wrong_shape, root / "misfit", rank=8, seed=4)),
    }


@functools.lru_cache(maxsize=16)
@torch.inference_mode()
def hf_greedy(model: str, adapter_path: str | None, prompt: tuple[int, ...]) -> list[int]:
    net = hf_merged_model(model, adapter_path) if adapter_path else hf_model(model)
    out = hf_greedy_generate(net, [prompt], MAX_NEW)
    return out[0, len(prompt) :].tolist()


def expected(model: str, lora: LoRARequest | None, prompt: list[int]) -> list[int]:
    return hf_greedy(model, lora.lora_path if lora else None, tuple(prompt))


def generate(llm: LLM, prompts: list[list[int]], lora: Any) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leak(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks, "KV blocks leaked"


def check_parity_and_mixing(llm: LLM, model: str, adapters: dict[str, LoRARequest]) -> None:
    sql, chat = adapters["sql"], adapters["chat"]
    for lora in (sql, chat):
        for _ in range(2):  # the second time from the prefix cache (salted by the adapter)
            got = generate(llm, ENGINE_PROMPTS, lora)
            for i, prompt in enumerate(ENGINE_PROMPTS):
                assert got[i] == expected(model, lora, prompt), f"{lora.lora_name}, prompt {i}: differs from HF merged"
    base = generate(llm, ENGINE_PROMPTS, None)
    assert base == [expected(model, None, p) for p in ENGINE_PROMPTS]
    assert base != generate(llm, ENGINE_PROMPTS, sql), "the adapter should change the output"
    # one batch: every prompt under sql, chat and the base model, interleaved
    rows = [(p, lora) for p in ENGINE_PROMPTS for lora in (sql, None, chat)]
    mixed = generate(llm, [p for p, _ in rows], [lora for _, lora in rows])
    for (prompt, lora), got_row in zip(rows, mixed, strict=True):
        assert got_row == expected(model, lora, prompt), f"{lora and lora.lora_name} differs in a mixed batch"
    assert_no_leak(llm)


def check_bad_adapters_leave_the_engine_serving(llm: LLM, model: str, adapters: dict[str, LoRARequest]) -> None:
    with pytest.raises(LoRAError, match=r"'missing' at '.*no-such-adapter'"):
        generate(llm, ENGINE_PROMPTS[:1], adapters["missing"])
    with pytest.raises(LoRAError, match=r"'big'.*rank 32 is over max_lora_rank=16"):
        llm.add_lora(adapters["big"])
    with pytest.raises(LoRAError, match="'misfit'"):  # refused by the ranks: its down_proj cannot fit
        generate(llm, ENGINE_PROMPTS[:2], adapters["misfit"])
    assert 5 not in {a.lora_int_id for a in llm.list_loras()}
    assert llm.llm_engine.dead is None
    assert generate(llm, ENGINE_PROMPTS[:1], adapters["sql"]) == [expected(model, adapters["sql"], ENGINE_PROMPTS[0])]
    assert_no_leak(llm)


def test_tp1_in_process(model: str, adapters: dict[str, LoRARequest]) -> None:
    llm = LLM(model, **LORA_KWARGS)
    try:
        check_parity_and_mixing(llm, model, adapters)
        check_bad_adapters_leave_the_engine_serving(llm, model, adapters)
        assert llm.remove_lora(2) is True and [a.lora_name for a in llm.list_loras()] == ["sql"]
    finally:
        llm.llm_engine.shutdown()


def test_tp2_ray_workers(model: str, adapters: dict[str, LoRARequest], ray_session: None) -> None:  # noqa: F811
    llm = LLM(model, tensor_parallel_size=2, **LORA_KWARGS)
    try:
        assert llm.llm_engine.config.distributed_executor_backend == "ray"
        check_parity_and_mixing(llm, model, adapters)
        check_bad_adapters_leave_the_engine_serving(llm, model, adapters)
        assert llm.remove_lora(1) is True
        assert llm.llm_engine.executor.list_loras() == [2]  # every rank dropped it
        # a rank that died is an engine failure, not the adapter's
        ray.kill(llm.llm_engine.executor.workers[1], no_restart=True)
        with pytest.raises(RankFailedError, match=r"rank 1 of 2 .*load of LoRA adapter 'sql'"):
            llm.add_lora(adapters["sql"])
        assert llm.llm_engine.dead is not None
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def controller(model: str, ray_session: None) -> Iterator[Any]:  # noqa: F811
    handle = EngineController.remote(EngineConfig(model=model, disable_log_stats=True, **LORA_KWARGS))
    yield handle
    ray.get(handle.shutdown.remote(), timeout=60)
    ray.kill(handle)


async def _stream(controller: Any, rid: str, prompt: list[int], lora: LoRARequest | None) -> list[int]:
    gen = controller.generate.options(num_returns="streaming").remote(rid, prompt, GREEDY, lora)
    deltas: list[RequestDelta] = [await ref async for ref in gen]
    return [t for d in deltas for s in d.samples for t in s.token_ids]


def test_engine_controller_actor(controller: Any, model: str, adapters: dict[str, LoRARequest]) -> None:
    async def scenario() -> None:
        info = await controller.model_info.remote()
        assert (info["enable_lora"], info["max_loras"], info["max_lora_rank"]) == (True, 2, 16)
        with pytest.raises(LoRAError, match="rank 32 is over max_lora_rank") as err:
            await controller.add_lora.remote(adapters["big"])
        assert getattr(err.value, "cause", err.value).code == "lora_rank_exceeded"  # its fields crossed Ray
        with pytest.raises(LoRAError, match="'misfit'"):
            await controller.add_lora.remote(adapters["misfit"])
        assert await controller.add_lora.remote(adapters["chat"]) is True
        prompt = ENGINE_PROMPTS[1]
        got = await _stream(controller, "sql", prompt, adapters["sql"])  # loaded on first use
        assert got == expected(model, adapters["sql"], prompt)
        assert await _stream(controller, "chat", prompt, adapters["chat"]) == expected(model, adapters["chat"], prompt)
        assert [a.lora_int_id for a in await controller.list_loras.remote()] == [1, 2]
        assert await controller.remove_lora.remote(1) is True
        assert await _stream(controller, "base", prompt, None) == expected(model, None, prompt)
        stats = await controller.get_stats.remote()
        assert stats["num_free_device_blocks"] == stats["num_device_blocks"]

    asyncio.run(scenario())
