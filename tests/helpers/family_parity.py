"""One harness for every model family's parity with Hugging Face (tests/model_exec/families/).

Three levels, cheapest first:
- `assert_prefill_matches_hf`: our model alone (no engine), prefill logits at every position for one
  batched step and for a chunked prefill over cached context, at TP 1 and simulated TP 2/4 (threads);
- `assert_gloo_tp_matches_hf`: the same prefill over real gloo processes;
- `assert_engine_matches_hf`: the whole engine (paged KV, chunked prefill over cached context, prefix
  cache on, then the same prompts again from the prefix cache), greedy tokens equal to HF's `generate`
  for MAX_NEW tokens and logprobs close to HF's; over Ray workers with `tensor_parallel_size`.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch

from model_exec.parallel import TPGroup
from tests.helpers.hf_reference import hf_greedy_generate
from tests.helpers.tiny_models import (
    hf_prefill_logits,
    load_our_model,
    our_prefill_logits,
    run_in_rank_threads,
    tp_prefill_worker,
)

MAX_NEW = 64
# lengths 7, 1, 13 and 45: one single token, several crossing 8-token KV blocks and small windows
PREFILL_PROMPTS = [[5, 17, 33, 2, 101, 250, 7], [42], [3 + (7 * i) % 250 for i in range(13)], list(range(60, 105))]
ENGINE_PROMPTS = [list(range(10, 80)), [3 + (11 * i) % 250 for i in range(37)], [42, 7, 99]]
# the engine's settings for parity: small blocks and a small step budget, so the longer prompts prefill in
# chunks over their own cached context; prefix caching on; a small KV pool (the CPU default sizes it from
# free memory, up to GiBs per rank) so TP workers stay light on a shared 2-core test machine
ENGINE_KWARGS: dict[str, Any] = dict(
    block_size=8, max_num_batched_tokens=32, enable_prefix_caching=True, num_gpu_blocks_override=128
)


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def assert_logits_match(ours: list[torch.Tensor] | None, ref: list[torch.Tensor], atol: float = 1e-4) -> None:
    assert ours is not None
    for row, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.shape == b.shape, row
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m, r=row: f"prompt {r}: {m}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"prompt {row}: greedy tokens differ"


def assert_prefill_matches_hf(
    model_dir: str,
    world_sizes: tuple[int, ...] = (1, 2),
    atol: float = 1e-4,
    first_chunk: int = 3,
    reference_dir: str | None = None,
) -> None:
    """Prefill logits equal HF's at each TP size (threads), and for a chunked prefill at TP 1.

    `model_dir` is what raytp loads (a safetensors dir, a GGUF file or a dir holding one); HF's reference is
    the safetensors model in `reference_dir` (default: `model_dir` itself).
    """
    reference = hf_model(reference_dir or model_dir)
    ref = hf_prefill_logits(reference, PREFILL_PROMPTS)
    for ws in world_sizes:

        def rank(tp: TPGroup) -> list[torch.Tensor] | None:
            net, config = load_our_model(model_dir, tp)
            return our_prefill_logits(net, config, PREFILL_PROMPTS, tp)

        results = run_in_rank_threads(ws, rank)
        assert all(r is None for r in results[1:])
        assert_logits_match(results[0], ref, atol)
    chunked = [p for p in PREFILL_PROMPTS if len(p) > first_chunk]
    net, config = load_our_model(model_dir)
    ours = our_prefill_logits(net, config, chunked, first_chunk=first_chunk)
    assert_logits_match(ours, hf_prefill_logits(reference, chunked), atol)


def assert_gloo_tp_matches_hf(model_dir: str, world_size: int, tmp_path: Path, atol: float = 1e-4) -> None:
    """Real torch.distributed: `world_size` spawned processes, gloo all-reduce/gather."""
    out = tmp_path / f"logits-{world_size}.pt"
    init = f"file://{tmp_path / f'rendezvous-{world_size}'}"  # no port to pick or collide on
    ctx = mp.get_context("spawn")
    args = (world_size, init, model_dir, PREFILL_PROMPTS, str(out))
    procs = [ctx.Process(target=tp_prefill_worker, args=(r, *args)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world_size
    assert_logits_match(torch.load(out), hf_prefill_logits(hf_model(model_dir), PREFILL_PROMPTS), atol)


def hf_greedy_with_logprobs(model_dir: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """HF's greedy continuation (EOS ignored) and the log-probability of each chosen token."""
    return _hf_greedy_with_logprobs(model_dir, tuple(prompt))


@torch.inference_mode()
@functools.lru_cache(maxsize=16)  # a family's TP 1 and TP 2 engine tests compare with the same references
def _hf_greedy_with_logprobs(model_dir: str, prompt: tuple[int, ...]) -> tuple[list[int], list[float]]:
    gen = hf_greedy_generate(hf_model(model_dir), [prompt], MAX_NEW, output_logits=True, return_dict_in_generate=True)
    tokens = gen.sequences[0, len(prompt) :].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(gen.logits, tokens, strict=True)]
    return tokens, logprobs


def assert_engine_matches_hf(model_dir: str, logprob_atol: float = 1e-3, **engine_kwargs: Any) -> None:
    """The engine's greedy tokens equal HF's for every prompt, twice (the second time from the prefix
    cache), with each token's logprob within `logprob_atol` of HF's; no KV block leaks."""
    from raytp import LLM, SamplingParams

    llm = LLM(model_dir, **{**ENGINE_KWARGS, **engine_kwargs})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
        prompts = [{"prompt_token_ids": p} for p in ENGINE_PROMPTS]
        runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
        assert any(o.num_cached_tokens > 0 for o in runs[1]), "the second run should hit the prefix cache"
        bm = llm.llm_engine.block_manager
        bm.check_invariants()
        assert bm.num_free_device_blocks == bm.num_device_blocks, "KV blocks leaked"
    finally:
        llm.llm_engine.shutdown()
    for i, prompt in enumerate(ENGINE_PROMPTS):
        ref_tokens, ref_logprobs = hf_greedy_with_logprobs(model_dir, prompt)
        for run in runs:
            out = run[i].outputs[0]
            assert out.token_ids == ref_tokens, f"prompt {i}: greedy tokens differ from HF"
            assert out.logprobs is not None
            ours = [step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)]
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref_logprobs), atol=logprob_atol, rtol=0)
