"""The Triton paged-attention kernels against the torch reference backend, through Triton's interpreter.

Run as a child process by tests/ops/test_triton_attention.py with TRITON_INTERPRET=1 in its
environment: the interpreter is chosen when triton is imported, so it must be set before anything in
the process imports triton (pytest's own process may already have, through torch). Each case builds a
random paged layout (shuffled blocks, stale but finite cache contents, ragged rows), runs a sequence of
steps through both backends on separate copies of the cache, and compares outputs and caches.
Prints one JSON object: case id -> null (passed) or the failure text.

Two things are adjusted in this process only, both outside the code under test:
- Triton 3.9's interpreter keeps bfloat16 tensors as their raw uint16 bits and its `tl.dot` hands those
  bits to numpy's matmul (it widens only 8-bit floats), so a bf16 dot is garbage there. `_bf16_dot`
  widens bf16 operands to fp32 first, which is exact (bf16 is the top half of fp32) and what the GPU's
  bf16 MMA with fp32 accumulation computes; everything else of the bf16 kernels runs unpatched.
- raytp's C++ CPU kernels are reported unavailable, so the torch reference's cache writes and the tiny
  model's layers take their plain torch paths: loading that library takes a machine-wide lock that
  other processes may hold for minutes, and what is under test here is the Triton code.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ops.attention import cpu_kernels, triton_backend
from ops.attention.base import AttentionMetadata
from ops.attention.torch_backend import TorchAttentionBackend
from ops.attention.triton_backend import TritonAttentionBackend

Step = list[tuple[int, int]]  # (row, new tokens); rows with one new token first


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    heads: tuple[int, int] = (8, 2)  # query heads, KV heads
    head_dim: int = 32
    window: int | None = None
    soft_cap: float | None = None
    segments: int | None = None  # force decode split-KV segments (None: the backend's own choice)
    cached: list[int] = field(default_factory=list)  # tokens already in the cache per row
    steps: list[Step] = field(default_factory=list)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def run_case(case: Case, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = case.heads
    d, bs = case.head_dim, case.block_size
    final = list(case.cached)
    for step in case.steps:
        for row, n in step:
            final[row] += n
    need = [math.ceil(n / bs) for n in final]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous blocks
    tables = []
    for nb in need:
        tables.append(order[:nb])
        order = order[nb:]
    shape = (num_blocks, bs, hkv, d)
    # Stale but finite contents everywhere: a slot read without being masked would change the result.
    caches = [torch.randn(shape, generator=gen).to(case.dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    computed = list(case.cached)  # the cached prefix is whatever the cache holds there already
    kwargs = {"sliding_window": case.window, "logits_soft_cap": case.soft_cap}
    triton_attn = TritonAttentionBackend(hq, hkv, d, d**-0.5, **kwargs)
    torch_attn = TorchAttentionBackend(hq, hkv, d, d**-0.5, **kwargs)
    for step in case.steps:
        q_lens = [n for _, n in step]
        num_tokens = sum(q_lens)
        # q/k/v as views into one fused projection, as the model hands them over (strided rows)
        fused = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(case.dtype)
        q = fused[:, : hq * d].view(num_tokens, hq, d)
        k = fused[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
        v = fused[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
        slots, seq_lens = [], []
        for row, n in step:
            lo, hi = computed[row], computed[row] + n
            slots += [tables[row][p // bs] * bs + p % bs for p in range(lo, hi)]
            seq_lens.append(hi)
            computed[row] = hi
        width = max(len(tables[row]) for row, _ in step) + 1  # a spare column, as the runner pads
        block_tables = [tables[row] + [0] * (width - len(tables[row])) for row, _ in step]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(block_tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            num_decodes=sum(1 for n in q_lens if n == 1),
        )
        out = triton_attn.forward(q, k, v, *caches, meta)
        # The reference in fp32 from the same (rounded) inputs: it is the definition, not a rival kernel.
        ref = torch_attn.forward(q.float(), k.float(), v.float(), *(c.float() for c in ref_caches), meta)
        for c, r in zip(ref_caches, (k, v), strict=True):
            c.view(-1, hkv, d)[meta.slot_mapping] = r
        torch.testing.assert_close(out.float(), ref, **_tol(case.dtype), msg=lambda m, s=step: f"step {s}: {m}")
        for got, want in zip(caches, ref_caches, strict=True):
            assert torch.equal(got, want), f"step {step}: the cache differs from the written slots"


MIXED = {  # rows 0-2 decode, row 3 a fresh prompt, row 4 a chunk on cached context; then all decode
    "cached": [19, 47, 2, 0, 25],
    "steps": [[(0, 1), (1, 1), (2, 1), (3, 29), (4, 35)], [(i, 1) for i in range(5)]],
}
CHUNKED = {  # every token through forward: chunks, then decodes mixed with a chunk and a new prompt
    "cached": [0, 0, 0],
    "steps": [[(0, 21), (1, 7)], [(0, 17), (1, 16)], [(1, 1), (0, 12), (2, 11)], [(0, 1), (1, 1), (2, 1)]],
}
LONG_DECODE = {"cached": [150, 3, 70], "steps": [[(0, 1), (1, 1), (2, 1)]]}

CASES: dict[str, Case] = {
    "fp32-bs16-gqa4-mixed": Case(**MIXED),
    "fp32-bs32-mha-chunked": Case(block_size=32, heads=(4, 4), **CHUNKED),
    "fp32-bs128-mqa-d48-mixed": Case(block_size=128, heads=(8, 1), head_dim=48, **MIXED),
    "fp32-bs16-gqa3-chunked": Case(heads=(6, 2), **CHUNKED),
    "fp32-bs16-window5-softcap": Case(window=5, soft_cap=2.0, **MIXED),
    "fp32-bs32-window20-chunked": Case(block_size=32, window=20, **CHUNKED),
    "fp32-bs16-softcap-chunked": Case(soft_cap=1.5, **CHUNKED),
    "fp32-bs16-split4-decode": Case(segments=4, **LONG_DECODE),
    "fp32-bs16-split8-window40-decode": Case(segments=8, window=40, **LONG_DECODE),
    "fp16-bs16-gqa4-mixed": Case(dtype=torch.float16, **MIXED),
    "fp16-bs32-split2-decode": Case(dtype=torch.float16, block_size=32, segments=2, **LONG_DECODE),
    "bf16-bs16-gqa4-window9-chunked": Case(dtype=torch.bfloat16, window=9, **CHUNKED),
}

MODEL_CASE = "tiny-llama-chunked-prefill"


def run_tiny_model(seed: int) -> None:
    """The tiny GQA Llama (2 layers) with the triton backend in every layer gives the torch backend's logits
    over a chunked prefill (4 tokens, then the rest on cached context), as the model's layers call it."""
    import tempfile

    from model_exec.models import build_model, pack_weights
    from model_exec.parallel import TPGroup
    from model_exec.source import read_model_config, resolve_model
    from model_exec.weights import iter_weights
    from tests.helpers.tiny_models import make_tiny_llama, our_prefill_logits

    prompts = [[5, 17, 33, 2, 101, 250, 7, 9, 11], [42, 43, 44, 45, 46], [3 + (7 * i) % 250 for i in range(23)]]
    with tempfile.TemporaryDirectory() as tmp:
        src = resolve_model(make_tiny_llama(tmp, seed=seed))
        config = read_model_config(src)
        logits = []
        for backend in (TorchAttentionBackend, TritonAttentionBackend):
            net = build_model(config, TPGroup.single(), backend, "cpu", torch.float32)
            net.load_weights(iter_weights(src))
            pack_weights(net)
            logits.append(our_prefill_logits(net, config, prompts, block_size=16, first_chunk=4))
    want, got = logits
    assert want is not None and got is not None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _bf16_dot() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(h: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot  # type: ignore[method-assign]


def main(selected: list[str]) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (set before triton loads)"
    _bf16_dot()
    cpu_kernels.load_error = lambda: "not used by the interpreter check"  # type: ignore[assignment]
    results: dict[str, str | None] = {}
    policy: Callable[..., int] = triton_backend.decode_segments
    for seed, (case_id, case) in enumerate(CASES.items()):
        if selected and case_id not in selected:
            continue
        forced = case.segments
        triton_backend.decode_segments = policy if forced is None else (lambda *_, n=forced: n)
        try:
            run_case(case, seed)
            results[case_id] = None
        except Exception:
            results[case_id] = traceback.format_exc(limit=-3)
    triton_backend.decode_segments = policy
    if not selected or MODEL_CASE in selected:
        try:
            run_tiny_model(seed=len(CASES))
            results[MODEL_CASE] = None
        except Exception:
            results[MODEL_CASE] = traceback.format_exc(limit=-3)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
