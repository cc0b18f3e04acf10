"""The asynchronous step (async_scheduling) gives the synchronous step's outputs, in-process.

The matrix (each case runs the same requests through a synchronous and an asynchronous engine on the tiny
Llama and compares every output field: token ids, text, cumulative and per-token logprobs, prompt logprobs,
finish and stop reasons; then checks that no KV block leaked):

    greedy x {default, chunked prefill, no chunking, recompute preemption, swap preemption, prefix caching}
    seeded sampling with logprobs and penalties; eos and stop token ids; stop strings; max_tokens of 1..9;
    n / best_of (forks); prompt logprobs; structured outputs (JSON schema); LoRA; abort mid-stream.

Over Ray at TP 2: tests/cluster/test_async_step_ray.py.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from cluster.executor import InProcessExecutor
from raytp import LLM, SamplingParams, StructuredOutputsParams
from request.lora import LoRARequest
from tests.cluster.test_engine_parity import VARIANTS, tiny_prompts
from tests.helpers.lora_models import make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama

BASE: dict[str, Any] = dict(num_gpu_blocks_override=256, block_size=16, swap_space=0.05)


@functools.cache
def _model(root: str) -> str:
    return make_tiny_llama(Path(root) / "llama")


@pytest.fixture(autouse=True, params=["thread", "launch"])
def step_road(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every case on both roads of the asynchronous step: worker calls on a step thread, and the in-process
    executor's launch/resolve split (model_exec/step_launch.py; chosen on CUDA, forced here on the CPU)."""
    if request.param == "launch":
        monkeypatch.setattr(InProcessExecutor, "step_launcher", lambda self: self.launch_model)
    return str(request.param)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(str(tmp_path_factory.mktemp("async")))


def fields(outs: list[Any]) -> list[Any]:
    """Every user-visible field of a generate() call's outputs."""
    return [
        (
            o.request_id,
            o.prompt_logprobs,
            [
                (c.index, c.token_ids, c.text, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
                for c in o.outputs
            ],
        )
        for o in outs
    ]


def check_no_leaks(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks, "KV blocks leaked"
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks, "CPU swap blocks leaked"


def run_both(model: str, prompts: list[Any], params: Any, **kwargs: Any) -> tuple[list[Any], list[Any], LLM]:
    results = []
    llm = None
    for async_scheduling in (False, True):
        llm = LLM(model, **{**BASE, **kwargs, "async_scheduling": async_scheduling})
        outs = llm.generate(prompts, params, use_tqdm=False)
        check_no_leaks(llm)
        results.append(fields(outs))
        if not async_scheduling:
            llm.llm_engine.shutdown()
    assert llm is not None
    llm.llm_engine.shutdown()
    return results[0], results[1], llm


def token_prompts(n: int = 8) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in tiny_prompts(n)]


@pytest.mark.parametrize("variant", [*VARIANTS, "prefix_cache"])
def test_greedy_variants(model: str, variant: str) -> None:
    if variant == "prefix_cache":  # shared prefixes: later prompts hit the blocks the earlier ones filled
        prompts = [{"prompt_token_ids": [5] * 40 + p["prompt_token_ids"]} for p in token_prompts()] * 2
        kwargs: dict[str, Any] = dict(block_size=4, enable_prefix_caching=True)
    else:
        prompts, kwargs = token_prompts(), VARIANTS[variant]
    sync, asyn, llm = run_both(
        model, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), **kwargs
    )
    assert asyn == sync
    sched = llm.llm_engine.scheduler
    if variant in ("recompute", "swap"):  # the async engine was driven into the same kind of preemption
        assert sched.num_preemptions_recompute + sched.num_preemptions_swap > 0


def test_seeded_sampling_logprobs_and_penalties(model: str) -> None:
    params = [
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            top_k=40,
            seed=i,
            max_tokens=24,
            logprobs=3,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            ignore_eos=True,
        )
        for i in range(8)
    ]
    sync, asyn, _ = run_both(model, token_prompts(), params)
    assert asyn == sync


def test_eos_stop_tokens_and_max_tokens(model: str) -> None:
    """Sequences end at different steps (eos, a stop token, max_tokens 1..9): each is known one step late
    under the asynchronous step and its extra token never shows."""
    probe = LLM(model, **BASE)
    greedy = probe.generate(
        token_prompts(), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    probe.llm_engine.shutdown()
    params = []
    for i, out in enumerate(greedy):
        ids = out.outputs[0].token_ids
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ids[3 + i % 4]]))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=30, min_tokens=2))
    sync, asyn, _ = run_both(model, token_prompts(), params)
    assert asyn == sync
    assert {c[5] for _, _, comps in sync for c in comps} >= {"length", "stop"}


def test_stop_strings(model: str) -> None:
    probe = LLM(model, **BASE)
    greedy = probe.generate(
        token_prompts(), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    probe.llm_engine.shutdown()
    params = []
    for i, out in enumerate(greedy):
        text = out.outputs[0].text
        stop = text[4 + i : 6 + i] or "zz"
        params.append(
            SamplingParams(
                temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=i % 2 == 0
            )
        )
    sync, asyn, _ = run_both(model, token_prompts(), params)
    assert asyn == sync
    assert any(c[6] is not None for _, _, comps in sync for c in comps), "no stop string fired"


def test_n_best_of_and_prompt_logprobs(model: str) -> None:
    """Forks and prompt logprobs: the steps that sample them are never planned past (cluster/async_step.py)."""
    params = [
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, logprobs=2),
        SamplingParams(temperature=1.0, seed=4, n=2, best_of=3, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2),
        SamplingParams(temperature=0.7, seed=5, max_tokens=12),
    ]
    sync, asyn, _ = run_both(model, token_prompts(4), params, max_num_batched_tokens=16)
    assert asyn == sync


def test_structured_outputs(model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a"],
    }
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=spec if i % 2 else None)
        for i in range(6)
    ]
    sync, asyn, _ = run_both(model, token_prompts(6), params)
    assert asyn == sync


def test_lora(model: str, tmp_path: Path) -> None:
    adapter = LoRARequest("a", 1, make_peft_adapter(model, tmp_path / "a", rank=4))
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(model, **BASE, enable_lora=True, max_lora_rank=8, async_scheduling=async_scheduling)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        prompts = token_prompts(4)
        got = fields(llm.generate(prompts, params, use_tqdm=False, lora_request=adapter))
        got += fields(llm.generate(prompts, params, use_tqdm=False))
        check_no_leaks(llm)
        llm.llm_engine.shutdown()
        outs.append(got)
    assert outs[1] == outs[0]


def run_aborting(engine: Any, abort_at: int) -> dict[str, tuple[list[int], str | None]]:
    """Step the engine to the end, aborting r1 once it has shown `abort_at` tokens; each request's final tokens
    and finish reason."""
    shown: dict[str, list[int]] = {}
    final: dict[str, tuple[list[int], str | None]] = {}

    def take(deltas: list[Any]) -> None:
        for delta in deltas:
            got = shown.setdefault(delta.request_id, [])
            for sample in delta.samples:
                got.extend(sample.token_ids)
                if sample.finish_reason is not None:
                    final[delta.request_id] = (got, sample.finish_reason)
            if delta.request_id == "r1" and len(got) >= abort_at and not delta.finished:
                engine.abort_request("r1")

    while engine.has_unfinished_requests():
        take(engine.step())
        take(engine.collect_finished())
    return final


def test_abort_mid_stream(model: str) -> None:
    """Abort a request once it has shown 5 tokens, by hand-stepping the engine: the final output holds those
    5 (the in-flight sample is dropped), the other requests are untouched, and nothing leaks."""
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model, **BASE, async_scheduling=async_scheduling)
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for i, p in enumerate(tiny_prompts(4)):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        results.append(run_aborting(engine, 5))
        check_no_leaks(llm)
        engine.shutdown()
    assert results[1] == results[0]
    assert results[0]["r1"][1] == "abort" and len(results[0]["r1"][0]) == 5
