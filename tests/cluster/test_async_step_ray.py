"""The asynchronous step over Ray at TP 2: offline and through the serving loop (EngineController), its
outputs equal the synchronous engine's. Rank 0 fills the placeholders from its own samples and broadcasts
them to rank 1 (ModelRunner._fill_placeholders), so both ranks run the same ids."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.config import EngineConfig
from cluster.controller import EngineController
from raytp import LLM, SamplingParams
from tests.cluster.ray_helpers import (
    assert_all_blocks_free,
    ray_session,  # noqa: F401  (module fixture)
    tiny_prompts,
)
from tests.cluster.test_async_step import fields
from tests.cluster.test_speculative_engine import NGRAM, assert_same, make_loopy_llama
from tests.helpers.tiny_models import make_tiny_llama

pytestmark = pytest.mark.usefixtures("ray_session")

# chunked prefill (16-token budget) and preemption (40 blocks of 4 tokens for 8 sequences of up to 84 tokens)
SMALL: dict[str, Any] = dict(block_size=4, num_gpu_blocks_override=40, max_num_batched_tokens=16, swap_space=0.01)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(Path(tmp_path_factory.mktemp("models")))


def mixed_params() -> list[SamplingParams]:
    """Greedy, seeded with logprobs, early max_tokens and a stop token: sequences end at different steps."""
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(temperature=0.8, seed=i, max_tokens=24, logprobs=2, ignore_eos=True)
        if i % 3 == 1
        else SamplingParams(temperature=0.0, max_tokens=3 + i, stop_token_ids=[7, 9])
        for i in range(8)
    ]


def test_tp2_offline_async_equals_sync(model: str) -> None:
    prompts = [{"prompt_token_ids": p} for p in tiny_prompts()]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model, tensor_parallel_size=2, async_scheduling=async_scheduling, **SMALL)
        results.append(fields(llm.generate(prompts, mixed_params(), use_tqdm=False)))
        assert_all_blocks_free(llm)
        sched = llm.llm_engine.scheduler
        assert sched.num_preemptions_recompute + sched.num_preemptions_swap > 0, "the pool forced no preemption"
        llm.llm_engine.shutdown()
    assert results[1] == results[0]


def test_tp2_speculative_equals_plain(tmp_path: Path) -> None:
    """n-gram and draft-model speculation at TP 2 under chunked prefill and preemption: rank 0 verifies (and
    runs the draft, whose proposals it broadcasts), both ranks then run the ids the scheduler kept; greedy and
    seeded outputs equal the plain engine's (logprobs within 1e-4: verifying rows run the prefill attention
    kernel)."""
    loopy = make_loopy_llama(tmp_path)  # its greedy loops give prompt lookup runs to accept
    prompts = [{"prompt_token_ids": p} for p in tiny_prompts()]
    draft = {"method": "draft_model", "model": loopy, "num_speculative_tokens": 3}  # the target as its own draft
    results = []
    for spec in (None, NGRAM, draft):
        llm = LLM(loopy, tensor_parallel_size=2, speculative_config=spec, **SMALL)
        results.append(fields(llm.generate(prompts, mixed_params(), use_tqdm=False)))
        assert_all_blocks_free(llm)
        sched = llm.llm_engine.scheduler
        llm.llm_engine.shutdown()
        # (a draft accepting nearly all its proposals ends the rows in fewer steps, before the pool runs out:
        # the draft's pool under preemption is tested in-process, tests/cluster/test_speculative_engine.py)
        if spec is not draft:
            assert sched.num_preemptions_recompute + sched.num_preemptions_swap > 0, "the pool forced no preemption"
        if spec is not None:
            assert sched.spec_num_drafts > 0 and sched.spec_num_accepted_tokens > 0, spec["method"]
    assert_same(results[1], results[0])
    assert_same(results[2], results[0])


def test_tp2_serving_loop_async_equals_offline_sync(model: str) -> None:
    prompts = tiny_prompts()
    offline = LLM(model, **SMALL)
    expected = [
        o.outputs[0].token_ids
        for o in offline.generate([{"prompt_token_ids": p} for p in prompts], mixed_params(), use_tqdm=False)
    ]
    offline.llm_engine.shutdown()
    handle = EngineController.remote(EngineConfig(model=model, tensor_parallel_size=2, async_scheduling=True, **SMALL))
    try:

        async def run() -> list[list[int]]:
            async def one(i: int, prompt: list[int], params: SamplingParams) -> list[int]:
                gen = handle.generate.options(num_returns="streaming").remote(f"r{i}", prompt, params)
                deltas = [await ref async for ref in gen]
                assert deltas[-1].finished
                return [t for d in deltas for s in d.samples for t in s.token_ids]

            return await asyncio.gather(
                *(one(i, p, s) for i, (p, s) in enumerate(zip(prompts, mixed_params(), strict=True)))
            )

        assert asyncio.run(run()) == expected
        stats = ray.get(handle.get_stats.remote())
        assert stats.num_free_device_blocks == stats.num_device_blocks
    finally:
        ray.get(handle.shutdown.remote(), timeout=60)
        ray.kill(handle)
