"""EngineController: concurrent streams match the offline engine; abort, cancel and bad input behave.

One controller (TP=2 over Ray worker actors) serves every test in the module; each test ends with
all KV blocks free, which the next test re-checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.controller import EngineController
from cluster.loop_records import LoopStats, ModelInfo
from cluster.outputs import RequestDelta
from raytp import LLM, EngineConfig, RequestError, SamplingParams
from tests.cluster.ray_helpers import (
    generate_ids,
    greedy,
    ray_session,  # noqa: F401  (module fixture)
    tiny_prompts,
    wait_until,
)
from tests.helpers.tiny_models import make_tiny_llama

pytestmark = pytest.mark.usefixtures("ray_session")

MAX_NEW = 24
CONFIG = dict(block_size=4, kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(Path(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def reference(model: str) -> list[list[int]]:
    """Greedy tokens of the offline, in-process engine for tiny_prompts()."""
    return generate_ids(LLM(model, **CONFIG), tiny_prompts(), MAX_NEW)


@pytest.fixture(scope="module")
def controller(model: str, ray_session: None) -> Iterator[Any]:  # noqa: F811
    handle = EngineController.remote(EngineConfig(model=model, tensor_parallel_size=2, **CONFIG))
    yield handle
    ray.get(handle.shutdown.remote(), timeout=60)
    ray.kill(handle)


@pytest.fixture(autouse=True)
def all_blocks_free_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "controller" in request.fixturenames:
        ctl = request.getfixturevalue("controller")
        wait_until(lambda: _blocks_all_free(ctl), 10, "every KV block to be free after the test")


def _blocks_all_free(controller: Any) -> bool:
    stats = ray.get(controller.get_stats.remote())
    return stats.num_free_device_blocks == stats.num_device_blocks and stats.num_requests == 0


def _stream(controller: Any, request_id: str, prompt: list[int], params: SamplingParams) -> Any:
    return controller.generate.options(num_returns="streaming").remote(request_id, prompt, params)


async def _collect(gen: Any) -> list[RequestDelta]:
    return [await ref async for ref in gen]


def _tokens(deltas: list[RequestDelta], index: int = 0) -> list[int]:
    return [t for d in deltas for s in d.samples if s.index == index for t in s.token_ids]


def test_concurrent_streams_match_offline(controller: Any, reference: list[list[int]]) -> None:
    prompts = tiny_prompts()

    async def run() -> list[list[RequestDelta]]:
        gens = [_stream(controller, f"par-{i}", p, greedy(MAX_NEW)) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(_collect(g) for g in gens))

    all_deltas = asyncio.run(run())
    assert [_tokens(d) for d in all_deltas] == reference
    for prompt, deltas in zip(prompts, all_deltas, strict=True):
        assert deltas[0].prompt is not None and deltas[0].prompt.token_ids == prompt, "the first delta: the prompt"
        assert all(d.prompt is None for d in deltas[1:]), "...and only the first"
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].samples[-1].finish_reason == "length" and deltas[-1].error is None


def test_logprobs_and_several_samples_stream_per_sequence(controller: Any) -> None:
    prompt = tiny_prompts(3)[2]
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, logprobs=2, ignore_eos=True)
    deltas = asyncio.run(_collect(_stream(controller, "samples", prompt, params)))
    for index in (0, 1):
        seq_deltas = [s for d in deltas for s in d.samples if s.index == index]
        tokens = [t for s in seq_deltas for t in s.token_ids]
        logprobs = [e for s in seq_deltas for e in (s.logprobs or [])]
        assert len(tokens) == len(logprobs) == 10
        assert all(tok in entry for tok, entry in zip(tokens, logprobs, strict=True))
        assert seq_deltas[-1].finish_reason == "length"


def test_abort_ends_the_stream_and_frees_blocks(controller: Any) -> None:
    async def run() -> list[RequestDelta]:
        gen = _stream(controller, "to-abort", tiny_prompts(2)[1], greedy(400))
        first = await (await gen.__anext__())
        await controller.abort.remote("to-abort")
        return [first] + await _collect(gen)

    deltas = asyncio.run(run())
    assert deltas[-1].finished and deltas[-1].samples[-1].finish_reason == "abort"
    assert len(_tokens(deltas)) < 400
    assert _blocks_all_free(controller)


def test_cancelling_the_stream_aborts_the_request(controller: Any) -> None:
    async def run() -> None:
        gen = _stream(controller, "to-cancel", tiny_prompts(2)[1], greedy(400))
        await (await gen.__anext__())  # running: it holds blocks now
        assert ray.get(controller.get_stats.remote()).num_running == 1
        ray.cancel(gen)

    asyncio.run(run())
    wait_until(lambda: _blocks_all_free(controller), 10, "the cancelled request's blocks to be freed")


def test_bad_prompts_raise_request_error_and_others_continue(controller: Any, reference: list[list[int]]) -> None:
    prompts = tiny_prompts()

    async def run() -> tuple[list[list[RequestDelta]], list[RequestError]]:
        good = [_stream(controller, f"ok-{i}", prompts[i], greedy(MAX_NEW)) for i in (3, 7)]
        errors = []
        for rid, bad in [("too-long", [5] * 600), ("bad-id", [5, 100_000])]:
            with pytest.raises(RequestError) as info:
                await _collect(_stream(controller, rid, bad, greedy(4)))
            errors.append(info.value.cause if hasattr(info.value, "cause") else info.value)
        return await asyncio.gather(*(_collect(g) for g in good)), errors

    good, errors = asyncio.run(run())
    # Typed across Ray: the field and OpenAI's code survive, no message needs parsing.
    assert (errors[0].param, errors[0].code) == ("prompt", "context_length_exceeded")
    assert "maximum context length is 512 tokens" in errors[0].message and "600 tokens" in errors[0].message
    assert errors[1].param == "prompt" and "[0, 320)" in errors[1].message
    assert [_tokens(d) for d in good] == [reference[3], reference[7]]


def test_duplicate_request_id_is_refused(controller: Any) -> None:
    async def run() -> None:
        gen = _stream(controller, "dup", tiny_prompts(1)[0], greedy(400))
        await (await gen.__anext__())
        with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
            await _collect(_stream(controller, "dup", tiny_prompts(1)[0], greedy(4)))
        await controller.abort.remote("dup")
        assert (await _collect(gen))[-1].finished

    asyncio.run(run())


def test_model_info_and_stats(controller: Any) -> None:
    info = ray.get(controller.model_info.remote())
    assert info.vocab_size == 320 and info.max_model_len == 512 and info.eos_token_ids == [2]
    assert info.block_size == 4 and info.tensor_parallel_size == 2 and info.num_device_blocks > 0
    assert (info.quantization, info.dtype) == ("none", "float32")  # both ranks answered "none"
    asyncio.run(_collect(_stream(controller, "for-stats", [5, 6, 7], greedy(3))))
    stats = ray.get(controller.get_stats.remote())
    assert isinstance(stats, LoopStats) and isinstance(info, ModelInfo)  # typed records cross Ray intact
    assert stats.num_waiting == stats.num_running == stats.num_swapped == 0 and stats.healthy
    assert 0.0 <= stats.kv_usage <= 1.0 and stats.num_free_cpu_blocks <= stats.num_cpu_blocks
    assert stats.num_preemptions == stats.num_preemptions_recompute + stats.num_preemptions_swap
    assert 0.0 <= stats.prefix_cache_hit_rate <= 1.0
    assert stats.prompt_tokens_total >= 3 and stats.generation_tokens_total >= 3
    ray.get(controller.check_health.remote())  # healthy: returns
