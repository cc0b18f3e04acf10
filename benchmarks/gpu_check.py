"""One prepared check of raytp's CUDA road on a bare one-GPU machine (issues 29, 42): <= 8 minutes on an H200.

    PYTHONPATH=. python benchmarks/gpu_check.py --out DIR [--budget-s 480] [--phases a,b,...] [--no-hf-timing]
    PYTHONPATH=. python benchmarks/gpu_check.py --out DIR --smoke-cpu   # the phases' code on a CPU, no figures

Needs CUDA torch, Triton and transformers only: no install step, no Ray, no network (raytp's in-process
executor at TP=1 runs the whole CUDA road below the controller). Phases, in order, each guarded so a
failure is recorded and the next one still runs, all under one time budget (a phase that would start
past it is skipped and says so):

1. env: torch / CUDA / Triton / transformers versions, the device, its HBM bandwidth (nominal by name:
   H100 SXM 3.35 TB/s, H100 PCIe 2.0, H200 4.8; and measured with a device-to-device copy).
2. tiny: a tiny fp32 Llama (random weights) through raytp with decode CUDA graphs, with enforce_eager and
   with async_scheduling, greedy, token for token against HF `generate` on the same GPU.
3. hf8b: a Llama-3-8B-shaped bf16 model with random weights, built by transformers on the device and saved;
   HF's references (greedy tokens with top-5 logprobs; the log-softmax over prompt + HF's own greedy
   continuation, for teacher-forced parity), HF single-stream ms/token (128 in / 256 out) and HF offline
   throughput (256 prompts of 512 in / 256 out).
4. sync, async, fp8: raytp at gpu_memory_utilization 0.9 (default settings; async_scheduling; quantization
   fp8, when this raytp has it), each measured the same way (benchmarks/common/gpu_profile.py):
   - the first batch after start (64 fresh prompts) and the same again: its seconds and the Triton variants
     it compiled (a warm start compiles none);
   - parity: free-running greedy as vLLM's `check_logprobs_close` (where the tokens first differ, each
     must be in the other's top-5; a bf16 engine fails otherwise), and teacher-forced: raytp's
     `prompt_logprobs` over HF's continuation at every position (top-1 agreement, max |delta logprob|);
   - single stream, offline with fresh prompts (no prefix-cache hits), the HBM roofline fractions and the
     ratio to HF;
   - decode steps at 1 and 256 rows: wall ms per step, device-busy ms (union of kernels and copies),
     host gap, kernels per step by kind, non-GEMM kernels per decoder layer, the top kernels by time and
     the host ops by self CPU time.
5. kvfull: the pool filled past capacity (max_num_seqs rows at a long context) without an out-of-memory.
6. cuda_tests: pytest on the CUDA cases (`-k cuda`) of tests/ops (but the C++ CPU kernels' files), of
   tests/model_exec/test_cuda_graphs.py (graph replay against eager) and of tests/model_exec/test_fp8.py
   (the FP8 product on the device; a tiny model in fp8 against bf16), when pytest is installed.

Writes DIR/gpu_check.log (everything printed, raytp's own log lines included: the attention backend
chosen, the KV sizing line, the CUDA-graph capture, the warm start) and DIR/gpu_check.json (the figures),
rewritten after every phase. Without a CUDA device it stops at the first CUDA call, saying "no CUDA device"
(exit status 2).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common.gpu_profile import compiled_variants, decode_steps, random_prompts, synchronize, teacher_forced

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("gpu_check")

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# Nominal HBM bandwidth by device name, most specific first (bytes/s).
NOMINAL_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 2.0e12),
)
# --smoke-cpu: the same phases on the CPU with this small shape (checks the script, measures nothing)
SMOKE_SHAPE = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32,
)  # fmt: skip
DEVICE = "cuda"
PARITY_PROMPTS, PARITY_PROMPT_LEN, PARITY_TOKENS, TOP_LOGPROBS = 4, 32, 32, 5
SINGLE_IN, SINGLE_OUT = 128, 256
OFFLINE_PROMPTS, OFFLINE_IN, OFFLINE_OUT = 256, 512, 256


class BudgetExceeded(Exception):
    pass


class Check:
    """The results, the time budget and the guarded phases."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.results: dict[str, Any] = {"budget_s": budget_s, "phases": {}}

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        tmp.replace(self.out / "gpu_check.json")

    def phase(self, name: str, needs_s: float, fn: Callable[[dict[str, Any]], None]) -> None:
        """Run fn(figures) unless fewer than needs_s seconds remain; record ok / failed / skipped."""
        entry: dict[str, Any] = {}
        self.results["phases"][name] = entry
        if self.remaining() < needs_s:
            entry["status"] = f"skipped: {self.remaining():.0f} s left of the budget, the phase needs ~{needs_s:.0f}"
            log.warning("phase %s %s", name, entry["status"])
            self.save()
            return
        log.info("===== phase %s (%.0f s left)", name, self.remaining())
        start = time.monotonic()
        signal.alarm(max(1, int(self.remaining())))
        try:
            fn(entry)
            entry["status"] = "ok"
        except BudgetExceeded:
            entry["status"] = "stopped: the overall time budget ran out"
            log.error("phase %s stopped: the overall time budget ran out", name)
        except Exception as exc:  # noqa: BLE001 - every phase's failure is recorded, the next phase runs
            entry["status"] = f"failed: {type(exc).__name__}: {exc}"
            log.error("phase %s failed:\n%s", name, traceback.format_exc())
        finally:
            signal.alarm(0)
            entry["seconds"] = round(time.monotonic() - start, 1)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.save()
        log.info("phase %s: %s in %.1f s", name, entry["status"], entry["seconds"])


# ---------------------------------------------------------------------------------------------- helpers
def raytp_llm(model_dir: str, **kwargs: Any) -> Any:
    from raytp import LLM

    if DEVICE == "cpu":  # --smoke-cpu: the GPU-only settings do not apply
        kwargs.pop("gpu_memory_utilization", None)
        if kwargs.get("async_scheduling"):
            # The asynchronous step launches in place on CUDA only (cluster/executor.py); the smoke run takes that
            # road on the CPU too, so the GPU run's code path is the one the smoke run met.
            from unittest import mock

            from cluster.executor import InProcessExecutor

            with mock.patch.object(InProcessExecutor, "step_launcher", lambda self: self.launch_model):
                return LLM(model_dir, device=DEVICE, distributed_executor_backend="inprocess", **kwargs)
    return LLM(model_dir, device=DEVICE, distributed_executor_backend="inprocess", **kwargs)


def async_road(llm: Any) -> str | None:
    """How the engine's asynchronous step reaches the model: "launch" (launched in place, resolved on the host
    thread: model_exec/step_launch.py), "thread" (a step thread), None when it steps synchronously."""
    engine = llm.llm_engine
    if engine.pipeline is None:
        return None
    return "launch" if engine.pipeline.submit == engine.executor.launch_model else "thread"


def raytp_generate(llm: Any, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None) -> list[Any]:
    from raytp import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def shard_of(llm: Any) -> Any:
    return llm.llm_engine.executor.worker.shard


def hf_generate(model: Any, prompts: list[list[int]], max_new: int, scores: bool = False) -> Any:
    """The tests' HF reference (tests/helpers/hf_reference.py), on the GPU; with scores, raw logits per step."""
    from tests.helpers.hf_reference import hf_greedy_generate

    return hf_greedy_generate(model, prompts, max_new, return_dict_in_generate=scores, output_logits=scores)


def timed(fn: Callable[..., Any], *args: Any) -> float:
    synchronize()
    start = time.perf_counter()
    fn(*args)
    synchronize()
    return time.perf_counter() - start


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_logprobs_close(
    ours: list[tuple[list[int], list[dict[int, float]]]], theirs: list[tuple[list[int], list[dict[int, float]]]]
) -> dict[str, Any]:
    """vLLM's check_logprobs_close: per sequence, tokens must agree until the first position where they
    differ; there each side's token must be in the other's top logprobs, and the rest is not compared."""
    report: dict[str, Any] = {"identical": 0, "diverged_close": [], "mismatch": []}
    for i, ((a_ids, a_lp), (b_ids, b_lp)) in enumerate(zip(ours, theirs, strict=True)):
        for pos, (a, b) in enumerate(zip(a_ids, b_ids, strict=True)):
            if a == b:
                continue
            if a in b_lp[pos] and b in a_lp[pos]:
                report["diverged_close"].append({"seq": i, "position": pos})
            else:
                report["mismatch"].append({"seq": i, "position": pos, "raytp": a, "hf": b})
            break
        else:
            report["identical"] += 1
    return report


# ----------------------------------------------------------------------------------------------- phases
def phase_env(fig: dict[str, Any]) -> None:
    import transformers

    props = torch.cuda.get_device_properties(0)
    fig["torch"], fig["cuda"], fig["transformers"] = torch.__version__, torch.version.cuda, transformers.__version__
    try:
        import triton

        fig["triton"] = triton.__version__
    except ImportError as exc:
        fig["triton"] = f"not importable: {exc}"
    fig["device"], fig["memory_gib"] = props.name, round(props.total_memory / 2**30, 1)
    fig["nominal_bandwidth_tb_s"] = next((bw / 1e12 for key, bw in NOMINAL_BANDWIDTH if key in props.name), None)
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB copied: 2 GiB moved per copy
    dst = torch.empty_like(buf)
    dst.copy_(buf)
    best = min(timed(dst.copy_, buf) for _ in range(10))
    fig["measured_copy_bandwidth_tb_s"] = round(2 * buf.numel() / best / 1e12, 3)
    del buf, dst
    log.info("env: %s", json.dumps(fig))


def phase_tiny(fig: dict[str, Any], workdir: Path) -> None:
    """A tiny fp32 Llama token for token against HF: with CUDA graphs, eager, and the asynchronous step."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_models import make_tiny_llama

    model_dir = make_tiny_llama(workdir / "tiny")
    prompts = random_prompts(6, 12, 259, seed=1) + [[1, 5, 6], [1] + list(range(40, 90))]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    want = [hf_generate(hf, [p], 48)[0, len(p) :].tolist() for p in prompts]
    del hf
    free_cuda()
    for key, settings in (
        ("graphs", {}),
        ("eager", {"enforce_eager": True}),
        ("async", {"async_scheduling": True}),
    ):
        # A fixed small pool: sized by memory, a tiny model's pool would be millions of blocks.
        llm = raytp_llm(model_dir, dtype="float32", num_gpu_blocks_override=4096, **settings)
        shard = shard_of(llm)
        fig[f"{key}_attention_backend"] = _backend_name(shard)
        fig[f"{key}_cuda_graphs"] = shard.runner.decode_graphs is not None
        fig[f"{key}_async_road"] = async_road(llm)
        del shard
        try:
            got = [o.token_ids for o in raytp_generate(llm, prompts, 48)]
        finally:
            _close(llm)
        fig[f"{key}_identical"] = sum(g == w for g, w in zip(got, want, strict=True))
        fig[f"{key}_of"] = len(prompts)
        log.info("tiny fp32 (%s): %d/%d sequences token for token", key, fig[f"{key}_identical"], len(prompts))
        if fig[f"{key}_identical"] != len(prompts):
            raise AssertionError(f"tiny fp32 ({key}): raytp differs from HF: {got} vs {want}")


def _backend_name(shard: Any) -> str:
    for module in shard.runner.model.modules():
        attn = getattr(module, "attn", None)
        if attn is not None and hasattr(attn, "name"):
            return str(attn.name)
    return "unknown"


class Sizes:
    """The check's workload sizes; `--smoke-cpu` shrinks them (and the model) to run the phases' code on a CPU."""

    def __init__(self, smoke: bool) -> None:
        self.single_in, self.single_out = (32, 16) if smoke else (SINGLE_IN, SINGLE_OUT)
        self.offline = (8, 64, 16) if smoke else (OFFLINE_PROMPTS, OFFLINE_IN, OFFLINE_OUT)
        self.profile_rows = (1, 8) if smoke else (1, 256)
        self.profile_steps = 4 if smoke else 30
        self.cold_prompts = 4 if smoke else 64  # the first batch after start: its time holds any JIT


def build_model(fig: dict[str, Any], workdir: Path, state: dict[str, Any], smoke: bool) -> Any:
    """The 8B-shaped bf16 model (random weights), saved for raytp; returns HF's copy on the device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.helpers.tiny_models import save_byte_tokenizer

    shape = {**LLAMA3_8B, **(SMOKE_SHAPE if smoke else {})}
    model_dir = workdir / "llama3-8b-shaped"
    cfg = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(DEVICE):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    state["weight_bytes"] = sum(p.numel() * p.element_size() for p in hf.parameters())
    hf.save_pretrained(model_dir)
    save_byte_tokenizer(model_dir)
    state.update(model_dir=str(model_dir), vocab=shape["vocab_size"], num_layers=shape["num_hidden_layers"])
    fig["build_and_save_s"] = round(time.perf_counter() - start, 1)
    fig["weight_gib"] = round(state["weight_bytes"] / 2**30, 2)
    log.info("built and saved the 8B-shaped model (%.2f GiB) in %.1f s", fig["weight_gib"], fig["build_and_save_s"])
    return hf


def phase_hf8b(fig: dict[str, Any], workdir: Path, check: Check, state: dict[str, Any], hf_timing: bool) -> None:
    """Build the model; HF's references (free-running greedy tokens with top-5, the teacher-forced log-softmax
    over prompt + HF's continuation) and, with hf_timing, HF's single-stream and offline speed."""
    sizes: Sizes = state["sizes"]
    hf = build_model(fig, workdir, state, state["smoke"])
    vocab = state["vocab"]
    parity_prompts = random_prompts(PARITY_PROMPTS, PARITY_PROMPT_LEN, vocab, seed=2)
    out = hf_generate(hf, parity_prompts, PARITY_TOKENS, scores=True)
    steps = torch.stack(out.logits, dim=1).float().log_softmax(dim=-1)  # [B, new, V]
    top = steps.topk(TOP_LOGPROBS, dim=-1)
    state["parity_prompts"] = parity_prompts
    state["hf_seqs"] = [
        (
            out.sequences[i, PARITY_PROMPT_LEN:].tolist(),
            [
                dict(zip(top.indices[i, t].tolist(), top.values[i, t].tolist(), strict=True))
                for t in range(PARITY_TOKENS)
            ],
        )
        for i in range(PARITY_PROMPTS)
    ]
    # Teacher-forced: HF's own greedy continuation fed back as a prompt; every position is compared.
    state["tf_seqs"] = out.sequences.tolist()
    with torch.inference_mode():
        state["hf_tf_logprobs"] = hf(out.sequences).logits.float().log_softmax(dim=-1).cpu()
    del out, steps, top
    if hf_timing:
        fig["hf_single_stream_ms_per_token"] = single_stream_ms(hf_generate, hf, sizes, vocab)
        if check.remaining() > 300:
            fig["hf_offline_output_tok_s"], fig["hf_offline_s"] = offline_rate(hf_generate, hf, sizes, vocab, 4)
        else:
            fig["hf_offline_output_tok_s"] = f"skipped: {check.remaining():.0f} s left"
        log.info("HF: %s", {k: v for k, v in fig.items() if k.startswith("hf_")})
    del hf
    free_cuda()


def single_stream_ms(generate: Callable[..., Any], model: Any, sizes: Sizes, vocab: int) -> float:
    """ms per output token of one stream past its first token (the prefill), after a warm-up."""
    single = random_prompts(1, sizes.single_in, vocab, seed=3)
    generate(model, single, 8)
    t1 = timed(generate, model, single, 1)
    tn = timed(generate, model, single, sizes.single_out)
    return round((tn - t1) / (sizes.single_out - 1) * 1e3, 2)


def offline_rate(generate: Callable[..., Any], model: Any, sizes: Sizes, vocab: int, seed: int) -> tuple[float, float]:
    """(output tokens/s, seconds) of the offline batch on prompts drawn from `seed` (fresh: no cache hits)."""
    n, length, out_len = sizes.offline
    secs = timed(generate, model, random_prompts(n, length, vocab, seed=seed), out_len)
    return round(n * out_len / secs, 1), round(secs, 1)


def _close(llm: Any) -> None:
    llm.llm_engine.shutdown()
    free_cuda()


def phase_raytp8b(
    fig: dict[str, Any], check: Check, state: dict[str, Any], label: str, strict: bool = False, **engine: Any
) -> None:
    """raytp on the 8B-shaped model with `engine` settings at gpu_memory_utilization 0.9: the first batch after
    start (its seconds and the Triton variants it compiled: a warm start compiles none), parity (free-running
    and teacher-forced against HF), single stream, offline with fresh prompts, and decode steps profiled at 1
    and 256 rows. strict: a token outside HF's top-5 where they first differ fails the phase (bf16 engines)."""
    if "model_dir" not in state:
        raise RuntimeError("the 8B-shaped model was not built (phase hf8b)")
    sizes: Sizes = state["sizes"]
    vocab, num_layers = state["vocab"], state["num_layers"]
    start = time.perf_counter()
    llm = raytp_llm(
        state["model_dir"],
        dtype="bfloat16",
        gpu_memory_utilization=0.9,
        max_model_len=4096,
        max_num_batched_tokens=8192,
        **engine,
    )
    shard = shard_of(llm)
    fig["settings"] = engine
    fig["load_s"] = round(time.perf_counter() - start, 1)
    fig["attention_backend"] = _backend_name(shard)
    fig["cuda_graphs"] = shard.runner.decode_graphs is not None
    fig["async_road"] = async_road(llm)
    fig["kv_blocks"] = shard.cache.num_device_blocks
    try:
        variants_at_start = compiled_variants()
        cold = random_prompts(sizes.cold_prompts, sizes.offline[1], vocab, seed=10)
        fig["first_batch_s"] = round(timed(raytp_generate, llm, cold, 8), 2)
        again = random_prompts(sizes.cold_prompts, sizes.offline[1], vocab, seed=11)
        fig["same_batch_again_s"] = round(timed(raytp_generate, llm, again, 8), 2)
        after = compiled_variants()
        fig["triton_variants_at_start"] = variants_at_start
        fig["triton_variants_compiled_by_first_batches"] = (
            None if after is None or variants_at_start is None else after - variants_at_start
        )
        ours = [
            (o.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in (o.logprobs or [])])
            for o in raytp_generate(llm, state["parity_prompts"], PARITY_TOKENS, logprobs=TOP_LOGPROBS)
        ]
        tokens = state.setdefault("tokens_by_engine", {})
        tokens[label] = [ids for ids, _ in ours]
        if label != "sync" and "sync" in tokens:
            fig["greedy_tokens_identical_to_sync"] = sum(
                a == b for a, b in zip(tokens[label], tokens["sync"], strict=True)
            )
        fig["parity_free_running"] = check_logprobs_close(ours, state["hf_seqs"])
        tf = raytp_prompt_logprobs(llm, state["tf_seqs"])
        fig["parity_teacher_forced"] = teacher_forced(tf, state["hf_tf_logprobs"], state["tf_seqs"], 1)
        log.info("%s parity: %s / %s", label, fig["parity_free_running"], fig["parity_teacher_forced"])
        fig["single_stream_ms_per_token"] = single_stream_ms(raytp_generate, llm, sizes, vocab)
        if check.remaining() > 90:
            fig["offline_output_tok_s"], fig["offline_s"] = offline_rate(
                raytp_generate, llm, sizes, vocab, 20 + len(label)
            )
        for rows in sizes.profile_rows:
            if check.remaining() < 45:
                break
            in_len = sizes.single_in if rows == 1 else sizes.offline[1] + sizes.offline[2] // 2
            fig[f"decode_{rows}_rows"] = decode_steps(
                llm, rows, in_len, vocab, seed=30 + rows, steps=sizes.profile_steps, num_layers=num_layers
            )
            log.info("%s decode at %d rows: %s", label, rows, fig[f"decode_{rows}_rows"])
    finally:
        del shard
        _close(llm)
    figures_against_peers(fig, check, state)
    log.info("%s: %s", label, {k: v for k, v in fig.items() if not k.startswith(("parity", "decode_"))})
    mismatch = fig["parity_free_running"]["mismatch"]
    if strict and mismatch:
        raise AssertionError(f"{label}: tokens differ beyond HF's top-{TOP_LOGPROBS} logprobs: {mismatch}")


def raytp_prompt_logprobs(llm: Any, seqs: list[list[int]]) -> list[list[dict[int, Any] | None]]:
    from raytp import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    return [o.prompt_logprobs for o in outs]


def figures_against_peers(fig: dict[str, Any], check: Check, state: dict[str, Any]) -> None:
    """The roofline fractions and the ratio to HF's offline speed, where both figures exist."""
    env = check.results["phases"].get("env", {})
    hf = check.results["phases"].get("hf8b", {})
    bandwidth = env.get("nominal_bandwidth_tb_s") or env.get("measured_copy_bandwidth_tb_s")
    fig["bandwidth_tb_s_for_roofline"] = bandwidth
    if bandwidth and "weight_bytes" in state:
        roofline(fig, state["weight_bytes"], bandwidth * 1e12, hf.get("hf_offline_output_tok_s"))


def roofline(fig: dict[str, Any], weight_bytes: int, bw: float, hf_tps: Any) -> None:
    """Bytes a decode step must read (every weight once, plus the KV of the context) over the bandwidth bw
    (bytes/s): the single-stream ms/token floor, and the output tokens/s ceiling of the offline batch's
    decode steps (prefill is compute-bound and left out, so the ceiling is generous)."""
    kv_per_token = 2 * LLAMA3_8B["num_hidden_layers"] * LLAMA3_8B["num_key_value_heads"] * 128 * 2  # bf16 K and V
    single_ctx = SINGLE_IN + SINGLE_OUT / 2
    step_bytes = weight_bytes + kv_per_token * single_ctx
    fig["roofline_single_stream_ms_per_token"] = round(step_bytes / bw * 1e3, 3)
    ours = fig.get("single_stream_ms_per_token")
    if isinstance(ours, float) and ours > 0:
        fig["fraction_of_roofline_single_stream"] = round(fig["roofline_single_stream_ms_per_token"] / ours, 3)
    batch_ctx = OFFLINE_IN + OFFLINE_OUT / 2
    batch_step = weight_bytes + kv_per_token * batch_ctx * OFFLINE_PROMPTS
    fig["roofline_offline_decode_output_tok_s"] = round(OFFLINE_PROMPTS / (batch_step / bw), 1)
    ours_tps = fig.get("offline_output_tok_s")
    if isinstance(ours_tps, float):
        fig["fraction_of_roofline_offline"] = round(ours_tps / fig["roofline_offline_decode_output_tok_s"], 3)
        if isinstance(hf_tps, float) and hf_tps > 0:
            fig["x_hf_offline"] = round(ours_tps / hf_tps, 2)


def phase_kvfull(fig: dict[str, Any], state: dict[str, Any]) -> None:
    """The pool filled past capacity at max_num_seqs rows: preemption, never an out-of-memory."""
    if "model_dir" not in state:
        raise RuntimeError("the 8B-shaped model was not built (phase hf8b)")
    ctx, out_len = (512, 8) if state["smoke"] else (4096, 32)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        log.info("kvfull: %.2f GiB free before loading", torch.cuda.mem_get_info()[0] / 2**30)
    llm = raytp_llm(
        state["model_dir"],
        dtype="bfloat16",
        gpu_memory_utilization=0.9,
        max_model_len=ctx,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        **({"num_gpu_blocks_override": 64} if state["smoke"] else {}),
    )
    shard = shard_of(llm)
    pool_blocks = shard.cache.num_device_blocks
    pool_tokens = pool_blocks * shard.cache.block_size
    rows = min(256, pool_tokens // ctx + 16)  # more rows at full context than the pool holds
    prompts = random_prompts(rows, ctx - out_len, state["vocab"], seed=5)
    del shard
    try:
        secs = timed(raytp_generate, llm, prompts, out_len)
    finally:
        _close(llm)
    fig.update(
        pool_blocks=pool_blocks, pool_tokens=pool_tokens, rows=rows, context=ctx, seconds_generating=round(secs, 1)
    )
    if torch.cuda.is_available():
        fig["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    log.info("kvfull: %s", fig)


def phase_cuda_tests(fig: dict[str, Any], check: Check) -> None:
    try:
        import pytest  # noqa: F401
    except ImportError:
        fig["note"] = "pytest is not installed: the CUDA-marked tests were not run"
        log.warning(fig["note"])
        return
    # The CUDA cases of the attention and cache-op tests (the C++ CPU kernels' files would build them first)
    # and the decode CUDA graphs' replay against eager.
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests" / "ops").glob("test_*.py")
        if not p.name.startswith(("test_cpu_", "test_fused_"))
    ) + ["tests/model_exec/test_cuda_graphs.py", "tests/model_exec/test_fp8.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", "cuda"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(10, check.remaining() - 5)
    )
    (check.out / "cuda_tests.log").write_text(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    fig.update(returncode=proc.returncode, summary=summary)
    log.info("cuda tests (%s): %s", " ".join(cmd[2:]), summary)
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise AssertionError(f"CUDA tests failed: {summary} (cuda_tests.log)")


# --------------------------------------------------------------------------------------------------- main
def _setup_logging(out: Path) -> None:
    fmt = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in (logging.FileHandler(out / "gpu_check.log"), logging.StreamHandler(sys.stdout)):
        handler.setFormatter(fmt)
        root.addHandler(handler)


PHASES = ("env", "tiny", "hf8b", "sync", "async", "fp8", "kvfull", "cuda_tests")


def main() -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="directory for gpu_check.log and gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=480.0, help="overall time budget (default 480 s)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    ap.add_argument("--no-hf-timing", action="store_true", help="hf8b builds the references only (a rerun)")
    ap.add_argument(
        "--smoke-cpu", action="store_true", help="run the phases' code on the CPU with a small model (no figures)"
    )
    args = ap.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        ap.error(f"unknown phases {unknown}; choose from {','.join(PHASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    _setup_logging(args.out)
    check = Check(args.out, args.budget_s)
    log.info("gpu_check: torch %s (CUDA build: %s), repository %s", torch.__version__, torch.version.cuda, ROOT)
    import raytp  # noqa: F401 - the front door imports on this machine (no Ray, no gguf, no llguidance)
    from cluster.config import QUANTIZATIONS

    if args.smoke_cpu:
        DEVICE = "cpu"
        phases = [p for p in phases if p not in ("env", "cuda_tests")]
        if "fp8" in QUANTIZATIONS:  # torch's CPU build has the rowwise-scaled _scaled_mm: run the phase's code
            from model_exec.layers.quantization import fp8

            fp8.refusal = lambda device, dtype: None
    elif not torch.cuda.is_available():  # the first CUDA call
        check.results["status"] = "no CUDA device"
        check.save()
        log.error("gpu_check: no CUDA device visible to torch %s: nothing to check here.", torch.__version__)
        return 2

    def on_alarm(signum: int, frame: Any) -> None:
        raise BudgetExceeded

    signal.signal(signal.SIGALRM, on_alarm)
    state: dict[str, Any] = {"sizes": Sizes(args.smoke_cpu), "smoke": args.smoke_cpu}
    with tempfile.TemporaryDirectory(prefix="raytp-gpu-check-") as tmp:
        workdir = Path(tmp)
        runs: dict[str, tuple[float, Callable[[dict[str, Any]], None]]] = {
            "env": (5, phase_env),
            "tiny": (20, lambda fig: phase_tiny(fig, workdir)),
            "hf8b": (100, lambda fig: phase_hf8b(fig, workdir, check, state, not args.no_hf_timing)),
            "sync": (80, lambda fig: phase_raytp8b(fig, check, state, "sync", strict=True)),
            "async": (60, lambda fig: phase_raytp8b(fig, check, state, "async", strict=True, async_scheduling=True)),
            "fp8": (60, lambda fig: phase_raytp8b(fig, check, state, "fp8", quantization="fp8")),
            "kvfull": (60, lambda fig: phase_kvfull(fig, state)),
            "cuda_tests": (30, lambda fig: phase_cuda_tests(fig, check)),
        }
        for name in PHASES:
            if name not in phases:
                continue
            if name == "fp8" and "fp8" not in QUANTIZATIONS:
                check.results["phases"][name] = {"status": "skipped: this raytp has no fp8 quantization"}
                continue
            needs_s, fn = runs[name]
            check.phase(name, needs_s, fn)
    # Every phase asked for must be ok; a skip for want of budget is a failure, fp8 absent from raytp is not.
    failed = [
        name
        for name, p in check.results["phases"].items()
        if not str(p.get("status", "")).startswith(("ok", "skipped: this raytp"))
    ]
    check.results["status"] = "ok" if not failed else f"not ok: {', '.join(failed)}"
    check.save()
    log.info("gpu_check: %s; figures in %s", check.results["status"], args.out / "gpu_check.json")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
