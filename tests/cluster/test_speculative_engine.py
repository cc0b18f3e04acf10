"""Speculative decoding (n-gram, and a draft model) gives the plain engine's outputs, field for field,
in-process on the tiny Llama.

Each case runs the same requests through an engine without speculation and one with each method's
`speculative_config` and compares every user-visible field (token ids, text, cumulative and per-token
logprobs within 1e-4, finish and stop reasons), then checks that no KV block leaked and that proposals were
made and some accepted. The tiny Llama's attention output is scaled down (x0.02), so its greedy text falls
into the loops prompt lookup predicts while every token still reads the KV cache (a wrong cache entry
changes the logprobs, compared exactly). The draft is the target itself (every greedy proposal should be
accepted: a draft KV entry out of step with the target's would show as rejections) or another random
tiny Llama of the same vocabulary (most rejected: the rejection path).
Over Ray at TP 2: tests/cluster/test_async_step_ray.py. The token distribution: tests/model_exec/test_spec_verify.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raytp import LLM, SamplingParams, StructuredOutputsParams
from request.lora import LoRARequest
from tests.cluster.test_async_step import BASE, check_no_leaks, fields, token_prompts
from tests.helpers.lora_models import make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama


def make_loopy_llama(root: Path) -> str:
    """The tiny Llama with its attention output scaled down (x0.02): greedy text falls into loops that prompt
    lookup predicts, so proposals are accepted, while every token still reads the KV cache."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_llama(root)
    weights_file = Path(path) / "model.safetensors"
    weights = load_file(weights_file)
    for name in weights:
        if "o_proj" in name:
            weights[name] = weights[name] * 0.02
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_loopy_llama(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama of the same tokenizer and other random weights: its proposals are mostly rejected."""
    return make_tiny_llama(tmp_path_factory.mktemp("draft"), seed=7)


NGRAM: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SELF_DRAFT = "self"  # the method param: the target as its own draft model


@pytest.fixture(params=["ngram", SELF_DRAFT])
def spec(request: pytest.FixtureRequest, model: str) -> dict[str, Any]:
    """Each engine case runs with prompt lookup and with a draft model (the target itself)."""
    if request.param == "ngram":
        return NGRAM
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}


def run_both(
    model: str, prompts: list[Any], params: Any, spec: dict[str, Any] = NGRAM, **kwargs: Any
) -> tuple[list[Any], list[Any], LLM]:
    results, llm = [], None
    for config in (None, spec):
        llm = LLM(model, **{**BASE, **kwargs, "speculative_config": config})
        results.append(fields(llm.generate(prompts, params, use_tqdm=False)))
        check_no_leaks(llm)
        llm.llm_engine.shutdown()
    assert llm is not None
    return results[0], results[1], llm


def assert_same(spec: Any, plain: Any, path: str = "outputs") -> None:
    """Equal, except floats (logprobs) within 1e-4: a verifying row runs through the prefill attention kernel
    and a plain decode through the decode kernel, whose sums associate differently (~1e-6 apart here)."""
    if isinstance(plain, float):
        assert spec == pytest.approx(plain, rel=1e-4, abs=1e-4), path
    elif isinstance(plain, dict):
        assert spec.keys() == plain.keys(), path
        for key in plain:
            assert_same(spec[key], plain[key], f"{path}[{key!r}]")
    elif isinstance(plain, (list, tuple)):
        assert type(spec) is type(plain) and len(spec) == len(plain), path
        for i, (a, b) in enumerate(zip(spec, plain, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif hasattr(plain, "__dataclass_fields__"):
        assert type(spec) is type(plain), path
        for name in plain.__dataclass_fields__:
            assert_same(getattr(spec, name), getattr(plain, name), f"{path}.{name}")
    else:
        assert spec == plain, path


def accepted(llm: LLM) -> int:
    return llm.llm_engine.scheduler.spec_num_accepted_tokens


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(max_num_batched_tokens=16, block_size=4),  # chunked prefill, proposals cut by the budget
        dict(num_gpu_blocks_override=40, block_size=4, preemption_mode="recompute"),
        dict(num_gpu_blocks_override=40, block_size=4, preemption_mode="swap"),
        dict(block_size=4, enable_prefix_caching=True),
    ],
    ids=["default", "chunked", "recompute", "swap", "prefix_cache"],
)
def test_greedy_output_is_identical(model: str, spec: dict, variant: dict) -> None:
    prompts = token_prompts() * (2 if variant.get("enable_prefix_caching") else 1)
    plain, with_spec, llm = run_both(
        model, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), spec, **variant
    )
    assert_same(with_spec, plain)
    assert accepted(llm) > 0
    if spec["method"] == "draft_model":  # the target as its own draft: its greedy proposals are the target's
        sched = llm.llm_engine.scheduler
        assert sched.spec_num_accepted_tokens >= 0.95 * sched.spec_num_draft_tokens, sched.spec_accepted_per_pos
    sched = llm.llm_engine.scheduler
    if "preemption_mode" in variant:
        assert sched.num_preemptions_recompute + sched.num_preemptions_swap > 0


def test_seeded_sampling_with_penalties_and_logprobs_is_identical(model: str, spec: dict) -> None:
    """Each position is sampled with the noise and penalties the plain engine uses there, so seeded samples
    are the same tokens, not just the same distribution."""
    params = [
        SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            seed=i,
            max_tokens=32,
            logprobs=3,
            frequency_penalty=0.2,
            repetition_penalty=1.1,
            min_tokens=4,
            ignore_eos=i % 2 == 0,
        )
        for i in range(8)
    ]
    plain, with_spec, llm = run_both(model, token_prompts(), params, spec)
    assert_same(with_spec, plain)
    assert llm.llm_engine.scheduler.spec_num_drafts > 0


def test_stops_inside_an_accepted_run_n_best_of_and_grammars(model: str, spec: dict) -> None:
    """A stop token, a stop string and max_tokens end the output at the exact token; forks speculate after
    the prompt step; a request under a grammar runs without proposals and still matches."""
    probe = LLM(model, **BASE)
    greedy = probe.generate(
        token_prompts(), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    probe.llm_engine.shutdown()
    params = []
    for i, out in enumerate(greedy):
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ids[5 + i % 7]]))
        elif i % 4 == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=30, stop=[text[8:10]], ignore_eos=True))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0.8, seed=i, n=2, best_of=3, max_tokens=3 + i, ignore_eos=True))
        else:
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            params.append(
                SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=schema))
            )
    plain, with_spec, llm = run_both(model, token_prompts(), params, spec)
    assert_same(with_spec, plain)
    assert {c[5] for _, _, comps in plain for c in comps} >= {"length", "stop"}
    assert llm.llm_engine.scheduler.spec_num_drafts > 0


def test_a_bad_or_unsupported_config_is_refused_at_start(model: str) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model, **BASE, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model, **BASE, speculative_config=NGRAM, async_scheduling=True)


def test_lora_rows_are_verified_with_their_adapter(model: str, spec: dict, tmp_path: Path) -> None:
    """Rows with an adapter and rows without share each step; a verifying row runs the target with its own
    adapter, so every row's output is the plain engine's (and the adapter's output is not the base's)."""
    adapter = LoRARequest("a", 1, make_peft_adapter(model, tmp_path / "a", rank=4, weights_scale=0.5))
    prompts = token_prompts()
    loras = [adapter if i % 2 == 0 else None for i in range(len(prompts))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        if i % 4 < 2
        else SamplingParams(temperature=0.8, seed=i, max_tokens=32, logprobs=2, ignore_eos=True)
        for i in range(len(prompts))
    ]
    results, llm = [], None
    for config in (None, spec):
        llm = LLM(model, **BASE, enable_lora=True, max_lora_rank=8, max_loras=1, speculative_config=config)
        results.append(fields(llm.generate(prompts, params, use_tqdm=False, lora_request=loras)))
        check_no_leaks(llm)
        llm.llm_engine.shutdown()
    plain, spec_out = results
    assert_same(spec_out, plain)
    base = LLM(model, **BASE)
    without = base.generate(prompts[0], params[0], use_tqdm=False)[0].outputs[0].token_ids
    base.llm_engine.shutdown()
    assert plain[0][2][0][1] != without, "the adapter does not change the output: the test would prove nothing"
    assert llm is not None and accepted(llm) > 0


def test_a_draft_of_other_weights_is_mostly_rejected_and_changes_nothing(model: str, other_draft: str) -> None:
    """Greedy and seeded rows with a draft the target disagrees with: the rejection path on every row, every
    output still the plain engine's, no block leaked (chunked prefill and preemption by swap on: the draft's
    pool is swapped beside the target's)."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.9, seed=i, max_tokens=32, logprobs=2, ignore_eos=True)
        for i in range(8)
    ]
    draft = {"method": "draft_model", "model": other_draft, "num_speculative_tokens": 4}
    variant = dict(num_gpu_blocks_override=40, block_size=4, preemption_mode="swap", max_num_batched_tokens=32)
    plain, with_spec, llm = run_both(model, token_prompts(), params, draft, **variant)
    assert_same(with_spec, plain)
    sched = llm.llm_engine.scheduler
    assert sched.spec_num_draft_tokens > 0
    assert sched.spec_num_accepted_tokens < 0.5 * sched.spec_num_draft_tokens, sched.spec_accepted_per_pos
    assert sched.num_preemptions_swap > 0


def test_unseeded_samples_with_a_random_draft_follow_the_targets_distribution(other_draft: str, tmp_path: Path) -> None:
    """A tiny random target (temperature 1) and a tiny random draft of other weights, k = 3: over 2,000
    unseeded samples, the histogram of each of the first output tokens the draft's verification emits matches
    the plain engine's (two-sample chi-square, p > 0.01; engine seed fixed, so the test is deterministic).
    Unseeded rows draw their noise from the engine's generator, so the two runs share no sample: this checks
    the distribution, where the seeded tests above check token identity."""
    from tests.model_exec.test_spec_verify import chi_square_p

    target = make_tiny_llama(tmp_path, seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 42, 9]}
    draft = {"method": "draft_model", "model": other_draft, "num_speculative_tokens": 3}
    runs = []
    for config in (None, draft):
        llm = LLM(target, **{**BASE, "num_gpu_blocks_override": 1024}, seed=11, speculative_config=config)
        outs = llm.generate([prompt] * 2000, params, use_tqdm=False)
        runs.append(torch.tensor([o.outputs[0].token_ids for o in outs]))
        if config is not None:
            assert llm.llm_engine.scheduler.spec_num_drafts > 0
        llm.llm_engine.shutdown()
    plain, spec = runs
    vocab = int(max(plain.max(), spec.max())) + 1
    for j in range(1, 4):  # position 0 comes from the prompt step, before any proposal
        a, b = torch.bincount(plain[:, j], minlength=vocab), torch.bincount(spec[:, j], minlength=vocab)
        pooled = (a + b).double() / (a + b).sum()  # the null: one distribution for both; test b against it
        assert chi_square_p(b, pooled) > 0.01, j


def test_a_draft_that_does_not_fit_the_target_is_refused_at_start(model: str, tmp_path: Path) -> None:
    other_vocab = make_tiny_llama(tmp_path / "v", vocab_size=300)
    cases = [
        ({"model": other_vocab}, "another vocabulary"),
        ({"model": str(tmp_path / "nowhere")}, "the draft model cannot be read"),
        ({"model": model, "prompt_lookup_max": 3}, 'prompt_lookup_min/max apply to method "ngram" only'),
        ({"model": model, "num_speculative_tokens": 0}, "num_speculative_tokens must be at least 1"),
        ({"model": None}, 'needs "model"'),
    ]
    for extra, message in cases:
        config = {"method": "draft_model", "num_speculative_tokens": 2, **extra}
        with pytest.raises(ValueError, match=message):
            LLM(model, **BASE, speculative_config=config)


def test_the_default_model_copies_code_text_and_chat_identically_and_accepts_most_proposals() -> None:
    """SmolLM2-135M-Instruct (the embedded default), greedy: a code copy, a quoted passage and a chat turn
    come out token for token as without speculation, and the input-grounded ones accept most proposals."""
    code = Path(__file__).with_name("test_async_step.py").read_text()[:900]
    passage = (
        "The mitochondrion is an organelle found in the cells of most eukaryotes. It uses aerobic respiration "
        "to generate adenosine triphosphate, which is used throughout the cell as a source of chemical energy."
    )
    prompts = [
        f"Copy this Python code exactly.\n\n{code}\n\nThe copy:\n",
        f"Passage: {passage}\nQuote the passage's first sentence word for word: \"",
    ]
    chat = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    results, rates = [], []
    for spec in (
        None,
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    ):
        # A 128 MiB KV pool (~2.8k tokens; the three requests need under 1k): the default (RAM/4, at most 4 GiB)
        # zero-filled cost each engine start ~20 s on the shared machine and held nothing more.
        llm = LLM(max_model_len=1024, kv_cache_memory_bytes=1 << 27, swap_space=0.05, speculative_config=spec)
        outs = llm.generate(prompts, params, use_tqdm=False) + llm.chat(chat, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs])
        sched = llm.llm_engine.scheduler
        assert sched.num_preemptions_recompute + sched.num_preemptions_swap == 0  # as with the default pool
        rates.append(sched.spec_num_accepted_tokens / max(1, sched.spec_num_draft_tokens))
        llm.llm_engine.shutdown()
    assert results[1] == results[0]
    assert rates[1] > 0.5, rates
