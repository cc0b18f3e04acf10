"""The Triton backend: its kernels against the torch reference through Triton's interpreter, its decode
split policy, and `auto`'s choice of backend and block size on a faked CUDA machine.

The interpreter is chosen when triton is first imported (`TRITON_INTERPRET=1`), and this pytest process
may already have imported triton (torch does, for inductor), so the kernel cases run in one child process
(`tests/ops/triton_interpreter_check.py`, ~15 s of CPU) whose JSON answer each parametrized test reads.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.config import EngineConfig
from cluster.device import CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE, default_block_size
from cluster.engine import resolve_config
from model_exec.config import ModelConfig
from ops.attention import FLASH_ATTN_BLOCK_MULTIPLE, get_attn_backend
from ops.attention.triton_backend import decode_segments
from tests.helpers.tiny_models import tiny_llama_config
from tests.ops.triton_interpreter_check import CASES, MODEL_CASE

ROOT = Path(__file__).resolve().parents[2]
NEEDS_TRITON = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (the `test` extra installs it)"
)


# ---------------------------------------------------------------- kernels, through the interpreter


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ops.triton_interpreter_check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"the interpreter run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    results: dict[str, str | None] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


@NEEDS_TRITON
@pytest.mark.parametrize("case_id", [*CASES, MODEL_CASE])
def test_kernels_match_the_torch_reference(interpreter_results: dict[str, str | None], case_id: str) -> None:
    assert case_id in interpreter_results, f"the interpreter run reported no result for {case_id}"
    failure = interpreter_results[case_id]
    assert failure is None, failure


# ---------------------------------------------------------------- kernels, compiled for NVIDIA GPUs


def _ptxas_missing() -> bool:
    spec = importlib.util.find_spec("triton")
    return spec is None or spec.origin is None or not (Path(spec.origin).parent / "backends/nvidia/bin/ptxas").exists()


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _compile(kernel: Any, capability: int, pointers: dict[str, str], constexprs: dict[str, Any]) -> None:
    """Compile `kernel` ahead of time for sm_<capability> (no GPU needed: Triton's own LLVM and ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name in ("scale", "soft_cap") else "i32")
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", capability, 32))


@pytest.mark.skipif(_ptxas_missing(), reason="triton with its NVIDIA backend (ptxas) is not installed")
@pytest.mark.parametrize(
    ("capability", "dtype", "heads", "head_dim", "block_size", "options", "decode_only", "segments"),
    [
        (90, torch.bfloat16, (32, 8), 128, 16, {}, False, 1),  # Llama-3-8B prefill / mixed step
        (90, torch.bfloat16, (32, 8), 128, 16, {}, True, 1),  # ... its decode step
        (80, torch.float16, (16, 8), 256, 256, {"sliding_window": 4096, "logits_soft_cap": 50.0}, True, 8),  # Gemma 2
        (90, torch.float32, (8, 1), 64, 128, {"sliding_window": 64}, False, 1),  # fp32 (IEEE dots), MQA
    ],
)
def test_kernels_compile_for_cuda(
    capability: int,
    dtype: torch.dtype,
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    options: dict[str, Any],
    decode_only: bool,
    segments: int,
) -> None:
    """The interpreter checks what the kernels compute, not that they compile: Triton's compiler is stricter
    (constexpr reassignment, loop-carried types, tl.dot shapes). Each launch variant of the backend goes
    through it, down to ptxas, with the backend's own compile-time parameters."""
    from ops.attention import triton_kernels
    from ops.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(*heads, head_dim, head_dim**-0.5, **options)
    dt = _DTYPE_NAMES[dtype]
    tensors = {"q_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr", "key_ptr", "value_ptr"}
    pointers = {name: f"*{dt}" for name in tensors}
    pointers |= {name: "*fp32" for name in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")}
    pointers |= {name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
    pointers["slot_mapping_ptr"] = "*i64"
    consts = backend.attention_constexprs(dtype, block_size, decode_only, segments)
    _compile(triton_kernels.paged_attention_kernel, capability, pointers, consts)
    _compile(triton_kernels.write_kv_kernel, capability, pointers, backend.write_kv_constexprs(block_size))
    if segments > 1:
        _compile(triton_kernels.reduce_segments_kernel, capability, pointers, backend.reduce_constexprs(segments))


# ---------------------------------------------------------------- decode split policy


@pytest.mark.parametrize(
    ("rows", "kv_heads", "max_keys", "expected"),
    [
        (1, 8, 4096, 16),  # one long stream on 132 SMs: split as far as allowed
        (1, 8, 700, 4),  # 4 segments of 175 keys; 8 would be under 128 keys each
        (1, 8, 200, 1),  # too short to be worth a merge pass
        (4, 8, 4096, 8),  # 32 programs x 8 = 256 <= 2 x 132; x 16 would overshoot
        (16, 8, 4096, 2),
        (256, 8, 4096, 1),  # a full batch already fills the GPU
    ],
)
def test_decode_segments(rows: int, kv_heads: int, max_keys: int, expected: int) -> None:
    assert decode_segments(rows, kv_heads, max_keys, num_sms=132) == expected


# ---------------------------------------------------------------- auto on a faked CUDA machine


def _fake_machine(monkeypatch: pytest.MonkeyPatch, installed: set[str]) -> None:
    """A CUDA device and exactly `installed` of flash_attn / triton / xformers importable (as stand-ins)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("flash_attn", "triton", "xformers", "xformers.ops"):
        present = name.split(".")[0] in installed
        # sys.modules[name] = None makes `import name` raise ImportError
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name) if present else None)


@pytest.mark.parametrize(
    ("installed", "dtype", "block_size", "expected", "reason"),
    [
        ({"flash_attn", "triton", "xformers"}, torch.float16, 256, "flash_attn", "usable here"),
        ({"flash_attn", "triton", "xformers"}, torch.bfloat16, 16, "triton", "multiple of 256; block_size is 16"),
        ({"flash_attn", "triton"}, torch.float32, 256, "triton", "float16 and bfloat16 only"),
        ({"triton", "xformers"}, torch.bfloat16, 256, "triton", "flash_attn package is not importable"),
        ({"xformers"}, torch.bfloat16, 16, "torch", "triton package is not importable"),
    ],
)
def test_auto_on_cuda_picks_a_backend_that_pages_in_place(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    installed: set[str],
    dtype: torch.dtype,
    block_size: int,
    expected: str,
    reason: str,
) -> None:
    _fake_machine(monkeypatch, installed)
    with caplog.at_level(logging.INFO, logger="ops.attention"):
        assert get_attn_backend("auto", "cuda", dtype, block_size).name == expected
    [record] = [r for r in caplog.records if r.name == "ops.attention"]  # one line
    message = record.getMessage()
    assert f"chose {expected!r}" in message and reason in message
    assert "xformers is never picked by auto: it gathers" in message
    assert record.levelno == (logging.WARNING if expected == "torch" else logging.INFO)


@pytest.mark.parametrize(
    ("installed", "dtype", "expected_block", "expected_backend"),
    [
        ({"flash_attn", "triton"}, "auto", FLASH_ATTN_BLOCK_MULTIPLE, "flash_attn"),
        ({"flash_attn", "triton"}, "float32", CUDA_BLOCK_SIZE, "triton"),  # flash-attn has no fp32
        ({"triton", "xformers"}, "auto", CUDA_BLOCK_SIZE, "triton"),
        ({"triton"}, "bfloat16", CUDA_BLOCK_SIZE, "triton"),
    ],
)
def test_auto_block_size_and_backend_are_chosen_together(
    monkeypatch: pytest.MonkeyPatch, installed: set[str], dtype: str, expected_block: int, expected_backend: str
) -> None:
    """resolve_config's default block size (as the engine resolves it) is one the chosen backend pages."""
    model = ModelConfig.from_hf_config(tiny_llama_config())  # before the fakes: transformers probes flash_attn
    _fake_machine(monkeypatch, installed)
    config = resolve_config(EngineConfig(device="cuda", dtype=dtype), model)
    assert config.block_size == expected_block
    assert config.dtype == ("float32" if dtype == "float32" else "bfloat16")  # the tiny config's: float32
    assert config.shard.attention_candidates[0] == expected_backend
    torch_dtype = getattr(torch, config.dtype)
    assert get_attn_backend("auto", "cuda", torch_dtype, config.block_size).name == expected_backend


def test_default_block_size_follows_the_named_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, {"flash_attn", "triton"})
    assert default_block_size("cuda", "flash_attn") == FLASH_ATTN_BLOCK_MULTIPLE
    assert default_block_size("cuda", "triton") == CUDA_BLOCK_SIZE
    assert default_block_size("cuda", "auto", "float") == CUDA_BLOCK_SIZE
    assert default_block_size("cpu", "auto") == CPU_BLOCK_SIZE


# ---------------------------------------------------------------- without a GPU or without triton


def test_triton_is_refused_off_cuda() -> None:
    with pytest.raises(ValueError, match="attention_backend='triton' cannot be used: it runs only on CUDA"):
        get_attn_backend("triton", "cpu", torch.float32, 16)


def test_triton_needs_a_float_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, {"triton"})
    with pytest.raises(ValueError, match="float32, float16 and bfloat16 only; the dtype is float64"):
        get_attn_backend("triton", "cuda", torch.float64, 16)


def test_backend_without_triton_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.attention and the backend module import without triton; building the backend names the package."""
    import ops.attention

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "ops.attention.triton_kernels", raising=False)
    monkeypatch.delattr(ops.attention, "triton_kernels", raising=False)  # set by an earlier import
    from ops.attention.triton_backend import TritonAttentionBackend

    with pytest.raises(ValueError, match="needs the triton package"):
        TritonAttentionBackend(8, 2, 64, 0.125)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        TritonAttentionBackend(8, 2, 512, 0.125)
