"""Greedy parity with Hugging Face transformers, token for token, across engine features.

Every variant must give the same tokens: chunked prefill, prefix-cache hits, and a KV pool
small enough to force recompute and swap preemption. After every run all blocks are free.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from raytp import LLM, SamplingParams
from tests.cluster.reference import PROMPTS, hf_greedy
from tests.helpers.tiny_models import make_tiny_llama, make_tiny_qwen2, make_tiny_untied_rope_scaled

MAX_NEW = 64


@functools.cache
def tiny_model_dir(kind: str, root: str) -> str:
    makers = {
        "llama": make_tiny_llama,
        "qwen2": make_tiny_qwen2,
        "untied_scaled": make_tiny_untied_rope_scaled,
    }
    return makers[kind](Path(root) / kind)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("models"))


VARIANTS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "no_chunking": dict(enable_chunked_prefill=False, max_model_len=512, max_num_batched_tokens=512),
    "recompute": dict(num_gpu_blocks_override=40, block_size=4, preemption_mode="recompute"),
    "swap": dict(num_gpu_blocks_override=40, block_size=4, preemption_mode="swap"),
}


def run_engine(model: str | None, prompts: list[list[int]], **kwargs: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, **kwargs)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks, "KV blocks leaked"
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks, "CPU swap blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm


def check_variant(model: str | None, prompts: list[list[int]], variant: str) -> None:
    expected = hf_greedy(model, prompts, MAX_NEW)
    got, llm = run_engine(model, prompts, **VARIANTS[variant])
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        first_diff = next((j for j, (a, b) in enumerate(zip(e, g, strict=False)) if a != b), None)
        assert g == e, f"prompt {i}: first difference at token {first_diff}"
    sched = llm.llm_engine.scheduler
    if variant == "recompute":
        assert sched.num_preemptions_recompute > 0, "pool too large to force recompute preemption"
    if variant == "swap":
        assert sched.num_preemptions_swap > 0, "pool too large to force swap preemption"


def tiny_prompts(n: int = 8) -> list[list[int]]:
    # token ids of different lengths (3..60) for the tiny random models' 256-token vocabulary
    return [[(7 * i + 13 * j) % 250 + 3 for j in range(3 + 8 * i)] for i in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "untied_scaled"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_models_match_hf(kind: str, variant: str, model_root: str) -> None:
    check_variant(tiny_model_dir(kind, model_root), tiny_prompts(), variant)


def test_tiny_prefix_cache_hits_match_hf(model_root: str) -> None:
    model = tiny_model_dir("llama", model_root)
    shared = [(5 * j) % 250 + 3 for j in range(40)]
    prompts = [shared + [(i * 11 + j) % 250 + 3 for j in range(1 + i)] for i in range(8)]
    expected = hf_greedy(model, prompts, MAX_NEW)
    llm = LLM(model, block_size=4, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == expected
    bm = llm.llm_engine.block_manager
    assert bm.prefix_cache_hits > 0, "shared prefixes were meant to hit the prefix cache"
    assert bm.num_free_device_blocks == bm.num_device_blocks


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", "chunked", "recompute", "swap"])
def test_smollm2_matches_hf(variant: str) -> None:
    from model_exec.source import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    prompts = [tok.encode(p) for p in PROMPTS]
    # quantization="none": token-exact parity with HF's fp32 dequantised load of the same GGUF; the kept-quantized
    # path has its own tests against the dequantised reference (tests/model_exec/test_gguf_quantized.py)
    kwargs = dict(VARIANTS[variant], quantization="none")
    if variant in ("recompute", "swap"):
        kwargs["num_gpu_blocks_override"] = 60
    expected = hf_greedy(None, prompts, MAX_NEW)
    got, llm = run_engine(None, prompts, **kwargs)
    assert got == expected
    if variant == "recompute":
        assert llm.llm_engine.scheduler.num_preemptions_recompute > 0
    if variant == "swap":
        assert llm.llm_engine.scheduler.num_preemptions_swap > 0


@pytest.mark.slow
def test_smollm2_prefix_cache_hits_match_hf() -> None:
    from model_exec.source import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    # Only whole KV blocks are cached: the shared prefix spans more than one block of the default size
    # (128 tokens on CPU).
    system = "You are a careful assistant. Answer briefly and precisely. " * 12
    prompts = [tok.encode(system + q) for q in PROMPTS[:4]]
    expected = hf_greedy(None, prompts, MAX_NEW)
    llm = LLM(None, enable_prefix_caching=True, quantization="none")  # exact parity with HF's fp32 weights
    assert len(tok.encode(system)) > llm.llm_engine.config.block_size
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    assert llm.llm_engine.block_manager.prefix_cache_hits > 0
