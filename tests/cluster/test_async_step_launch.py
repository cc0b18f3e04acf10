"""The asynchronous step launched in place (model_exec/step_launch.py), its device half faked.

A fake of the device API (model_exec/readback.py's DeviceApi) runs the readback's copies only when the test
says the device got there: until then each host buffer holds garbage. The engine is driven by hand so that the
"device" completes what was enqueued only when the host waits for it. Checked:
- step N+1 is launched while step N's copy has not run, and its outputs are still the synchronous engine's:
  its input ids read N's sampled ids from the device-side tensor, not from the host;
- a resolve waits for its step's event;
- the sampler's draws kept on the device give `Sampler.__call__`'s SeqSamples (every stage);
- the road is chosen for the in-process executor on CUDA only: a CPU engine keeps its step thread.

The whole async matrix on this road: tests/cluster/test_async_step.py (its "launch" cases).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import tempfile
import threading
from typing import Any

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.executor import InProcessExecutor
from model_exec import step_launch
from model_exec.device_samples import sample_on_device
from model_exec.readback import Reader
from model_exec.sampler import Sampler, SamplingMetadata
from request.sampling_params import SamplingParams
from tests.cluster.test_engine_parity import tiny_prompts
from tests.helpers.tiny_models import make_tiny_llama

GARBAGE = -12345  # what a host buffer holds until the fake device copied into it


class FakeStream:
    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, what the device will copy)


class FakeEvent:
    def __init__(self) -> None:
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.completed = threading.Event()

    def record(self, stream: FakeStream) -> None:
        self.copies, stream.pending = stream.pending, []
        if not self.copies:  # an event after compute only: the fake's kernels ran when they were called
            self.completed.set()

    def query(self) -> bool:
        return self.completed.is_set()

    def synchronize(self) -> None:
        # The host thread blocking on the device (a launch that needs the last step's tokens on the host): the
        # device runs on meanwhile. Any other thread (the executor's waiter, the test's resolver) waits for
        # the test to say the device got there.
        if threading.current_thread() is threading.main_thread():
            self.complete()
        self.completed.wait()

    def complete(self) -> None:
        with torch.inference_mode():  # the buffers were made in the launch's inference mode
            for host, value in self.copies:
                host.copy_(value)
        self.completed.set()


class FakeDevice:
    """DeviceApi on CPU tensors: a copy runs when `complete_all` says the device reached it."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []

    def current_stream(self) -> FakeStream:
        return FakeStream()

    def new_stream(self) -> FakeStream:
        return FakeStream()

    def new_event(self) -> FakeEvent:
        event = FakeEvent()
        self.events.append(event)
        return event

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        pass

    def copy_to_host(self, src: torch.Tensor, stream: FakeStream) -> torch.Tensor:
        host = torch.full(src.shape, GARBAGE, dtype=src.dtype)
        stream.pending.append((host, src.clone()))
        return host

    def complete_all(self, upto: int | None = None) -> None:
        """The device reaches the first `upto` events (all: None), in order."""
        for event in self.events[:upto]:
            if not event.query():
                event.complete()


@functools.cache
def _model() -> str:
    return make_tiny_llama(tempfile.mkdtemp())


def engine(async_scheduling: bool, launch: bool | None) -> LLMEngine:
    config = EngineConfig(model=_model(), num_gpu_blocks_override=256, block_size=16, async_scheduling=async_scheduling)
    return LLMEngine(config, executor_factory=lambda c, m: InProcessExecutor(c, m, launch_in_place=launch))


def add(e: LLMEngine, params: list[SamplingParams]) -> None:
    for i, (p, sp) in enumerate(zip(tiny_prompts(len(params)), params, strict=True)):
        e.add_request(f"r{i}", {"prompt_token_ids": p}, sp)


def collect(deltas: list[Any], into: dict[str, list[Any]]) -> None:
    for d in deltas:
        for s in d.samples:
            into.setdefault(d.request_id, []).append(
                (s.token_ids, s.text, s.logprobs, s.cumulative_logprob, s.finish_reason)
            )


def sync_outputs(params: list[SamplingParams]) -> dict[str, list[Any]]:
    """Every request's deltas from the synchronous engine: the reference the launched steps must equal."""
    sync = engine(False, False)
    add(sync, params)
    want: dict[str, list[Any]] = {}
    while sync.has_unfinished_requests():
        collect(sync.step(), want)
    sync.shutdown()
    return want


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, min_p=0.02, seed=3, max_tokens=9),
    # a host fill for the steps it decodes in (the sampler counts its output tokens on the host)
    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, repetition_penalty=1.3),
]


def test_the_next_step_reads_the_sampled_ids_on_the_device_before_the_host_has_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want = sync_outputs(PARAMS)

    e = engine(True, True)
    device = FakeDevice()
    e.executor.worker.shard.runner.reader = Reader(device)
    fills: list[bool] = []  # per device fill: the step that sampled the ids had not been read back yet
    real_fill = step_launch._device_fill

    def spy(runner: Any, rows: Any, placeheld: Any, prev: Any) -> Any:
        fill = real_fill(runner, rows, placeheld, prev)
        if fill is not None:
            fills.append(not prev.done())
        return fill

    monkeypatch.setattr(step_launch, "_device_fill", spy)
    add(e, PARAMS)
    assert e.pipeline is not None and e.pipeline.submit == e.executor.launch_model
    got: dict[str, list[Any]] = {}
    waits = 0
    while e.has_unfinished_requests():
        before = len(device.events)  # the events of the step this pipeline step launches come after
        steps = e.pipeline.step()
        try:
            while True:
                ready = next(steps)
                in_flight = e.pipeline.in_flight
                # the step the host waits for, while its copy has not run (a host fill may have waited for it)
                if waits < 3 and in_flight is not None and not in_flight.handle.result.__self__.done():
                    # the resolve of the step the host waits for blocks on its event, not before
                    waits += 1
                    resolver = threading.Thread(target=in_flight.handle.result)
                    resolver.start()
                    resolver.join(timeout=0.2)
                    assert resolver.is_alive(), "resolve returned before its step's readback completed"
                    device.complete_all(before)
                    resolver.join()
                # the device gets through the step the host waits for; the one launched after it still runs
                device.complete_all(before)
                concurrent.futures.wait([ready])
        except StopIteration as done:
            collect(done.value, got)
    bm = e.block_manager
    assert bm.num_free_device_blocks == bm.num_device_blocks, "KV blocks leaked"
    e.shutdown()
    assert got == want
    assert waits == 3
    # every decode step of the rows without penalties read its ids from the device while their copy had not run
    assert len(fills) >= 8 and all(fills), fills


def test_a_resolve_waits_for_its_event() -> None:
    device = FakeDevice()
    reader = Reader(device)
    tokens = torch.tensor([5, 7])
    readback = reader.start([tokens])
    assert readback.host()[0].tolist() == [GARBAGE, GARBAGE] and not readback.done()
    waiter = threading.Thread(target=readback.wait)
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()
    device.complete_all()
    waiter.join()
    assert readback.done() and readback.host()[0].tolist() == [5, 7]


def _meta(params: list[SamplingParams]) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata(
        params=params,
        seeds=list(range(100, 100 + n)),
        sample_indices=[0] * n,
        output_lens=[i % 3 for i in range(n)],
        num_samples=[1] * n,
        prompt_token_ids=[[1, 2, 3, i] for i in range(n)],
        output_token_ids=[[4, i, 9][: i % 3] for i in range(n)],
        eos_token_ids=(2,),
    )


@pytest.mark.parametrize("noise", [None, "counter"])
def test_draws_kept_on_the_device_are_the_samplers(noise: str | None) -> None:
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7, top_p=0.8, logprobs=0),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05, logprobs=2),
        SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(temperature=0.5, logit_bias={3: 5.0, 7: -2.0}, min_tokens=4, stop_token_ids=[9]),
        SamplingParams(temperature=0.0, min_tokens=2, logprobs=1),
    ]
    logits = torch.randn(len(params), 64) * 3
    want = Sampler(noise)(logits, _meta(params))
    kept = sample_on_device(Sampler(noise), logits, _meta(params))
    got = kept.to_seq_samples([t.clone() for t in kept.tensors()])
    assert [(s.token_ids, s.cumulative_logprob_deltas, s.logprobs) for s in got] == [
        (s.token_ids, s.cumulative_logprob_deltas, s.logprobs) for s in want
    ]
    all_greedy = [SamplingParams(temperature=0.0, logprobs=1)] * 3
    kept = sample_on_device(Sampler(noise), logits[:3], _meta(all_greedy))
    assert [s.token_ids for s in kept.to_seq_samples(kept.tensors())] == [
        s.token_ids for s in Sampler(noise)(logits[:3], _meta(all_greedy))
    ]


def test_a_fork_is_refused_on_the_device() -> None:
    meta = _meta([SamplingParams(temperature=1.0)])
    meta.num_samples = [2]
    with pytest.raises(ValueError, match="one token per row"):
        sample_on_device(Sampler(), torch.randn(1, 16), meta)


def test_the_road_is_chosen_on_cuda_only() -> None:
    e = engine(True, None)  # None: the executor decides from the device
    assert e.config.device == "cpu" and e.executor.step_launcher() is None
    assert e.pipeline is not None and e.pipeline.submit != e.executor.launch_model  # the step thread
    e.shutdown()


@pytest.mark.parametrize("enable_lora", [False, True])
def test_the_serving_loop_keeps_the_launch_road_unless_lora_is_on(
    monkeypatch: pytest.MonkeyPatch, enable_lora: bool
) -> None:
    """The serving loop (cluster/controller.py EngineLoop) streams concurrent requests through the launched step,
    its outputs the synchronous engine's; with LoRA on it takes its step thread (LoRA loads run there)."""
    from cluster.controller import EngineLoop

    monkeypatch.setattr(InProcessExecutor, "step_launcher", lambda self: self.launch_model)
    params = PARAMS[:3]
    want = sync_outputs(params)
    config = EngineConfig(
        model=_model(),
        num_gpu_blocks_override=256,
        block_size=16,
        async_scheduling=True,
        distributed_executor_backend="inprocess",
        disable_log_stats=True,
        enable_lora=enable_lora,
        max_lora_rank=8,
    )
    loop = EngineLoop(config)
    launched = loop.engine.pipeline is not None and loop.engine.pipeline.submit == loop.engine.executor.launch_model
    assert launched is not enable_lora

    async def serve() -> dict[str, list[Any]]:
        async def one(i: int, prompt: list[int], sp: SamplingParams) -> list[Any]:
            return [d async for d in loop.generate(f"r{i}", prompt, sp)]

        streams = await asyncio.gather(
            *(one(i, p, sp) for i, (p, sp) in enumerate(zip(tiny_prompts(len(params)), params, strict=True)))
        )
        await loop.shutdown()
        got: dict[str, list[Any]] = {}
        for deltas in streams:
            collect(deltas, got)
        return got

    assert asyncio.run(serve()) == want
