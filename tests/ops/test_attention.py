"""Paged attention backends against a plain per-sequence reference, and the backend registry.

The reference materialises each sequence's whole K/V, repeats K/V heads for GQA, applies a causal
mask where query i of a row sits at position seq_len - query_len + i, and softmaxes in fp32.
The cache starts filled with random (finite) values, so reading an unmasked stale slot would show.
Sliding windows and logit soft-capping (ops/attention/base.py) are applied by the reference too.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from ops.attention import ATTENTION_BACKENDS, get_attn_backend
from ops.attention.base import AttentionBackend, AttentionMetadata

CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device: flash-attn/xformers kernels run only on GPUs"
)

def _cpu_kernel_error() -> str | None:
    from ops.attention import cpu_kernels

    return cpu_kernels.load_error()


NEEDS_CPU_KERNEL = pytest.mark.skipif(
    "_cpu_kernel_error() is not None", reason="the C++ CPU kernel does not build here (no g++ or ninja)"
)
NEEDS_FLASH_ATTN = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None,
    reason="flash-attn is not installed (pip install flash-attn>=2.6)",
)
NEEDS_TRITON = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (it ships with CUDA torch)"
)
NEEDS_XFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("xformers") is None,
    reason="xformers is not installed (pip install xformers>=0.0.28)",
)


@dataclass(frozen=True)
class Case:
    backend: str
    device: str
    dtype: torch.dtype
    block_size: int
    atol: float


CASES = [
    pytest.param(Case("torch", "cpu", torch.float32, 16, 1e-5), id="torch-cpu-bs16"),
    pytest.param(Case("torch", "cpu", torch.float32, 4, 1e-5), id="torch-cpu-bs4"),
    pytest.param(Case("cpu", "cpu", torch.float32, 16, 1e-5), id="cpu-bs16", marks=NEEDS_CPU_KERNEL),
    pytest.param(Case("cpu", "cpu", torch.float32, 32, 1e-5), id="cpu-bs32", marks=NEEDS_CPU_KERNEL),
    pytest.param(Case("cpu", "cpu", torch.float32, 4, 1e-5), id="cpu-bs4", marks=NEEDS_CPU_KERNEL),
    pytest.param(Case("torch", "cuda", torch.float32, 16, 1e-4), id="torch-cuda-bs16", marks=NEEDS_CUDA),
    pytest.param(Case("triton", "cuda", torch.float16, 16, 2e-3), id="triton-bs16", marks=[NEEDS_CUDA, NEEDS_TRITON]),
    pytest.param(
        Case("triton", "cuda", torch.float32, 128, 1e-4), id="triton-fp32-bs128", marks=[NEEDS_CUDA, NEEDS_TRITON]
    ),
    pytest.param(
        Case("flash_attn", "cuda", torch.float16, 256, 2e-3),
        id="flash_attn-bs256",
        marks=[NEEDS_CUDA, NEEDS_FLASH_ATTN],
    ),
    pytest.param(
        Case("xformers", "cuda", torch.float16, 16, 2e-3),
        id="xformers-bs16",
        marks=[NEEDS_CUDA, NEEDS_XFORMERS],
    ),
    pytest.param(
        Case("xformers", "cuda", torch.float16, 4, 2e-3),
        id="xformers-bs4",
        marks=[NEEDS_CUDA, NEEDS_XFORMERS],
    ),
]
HEADS = [pytest.param((8, 2), id="gqa8x2"), pytest.param((4, 4), id="mha4")]
HEAD_DIM = 32


# ---------------------------------------------------------------- reference


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] are the last n positions of a sequence whose keys/values are k, v [S, Hkv, D]; a query
    at p sees keys p - window < key <= p; soft-capped scores are cap * tanh(score / cap)."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    q_pos = torch.arange(seq_len - n, seq_len).view(n, 1)
    k_pos = torch.arange(seq_len).view(1, seq_len)
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# ---------------------------------------------------------------- harness


@dataclass
class Seq:
    k: torch.Tensor  # [final_len, Hkv, D]: every key this sequence will ever have
    v: torch.Tensor
    blocks: list[int]  # physical blocks, in logical order
    computed: int = 0  # tokens already in the cache


class Harness:
    def __init__(
        self,
        case: Case,
        num_heads: int,
        num_kv_heads: int,
        final_lens: list[int],
        seed: int = 0,
        backend_cls: type[AttentionBackend] | None = None,  # default: the registry's answer for case.backend
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        self.case = case
        self.gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.bs = case.block_size
        need = [math.ceil(n / self.bs) for n in final_lens]
        num_blocks = sum(need) + 3
        order = torch.randperm(num_blocks, generator=self.gen).tolist()  # non-contiguous, shuffled blocks
        self.seqs: list[Seq] = []
        for n, nb in zip(final_lens, need, strict=True):
            blocks, order = order[:nb], order[nb:]
            self.seqs.append(
                Seq(self._randn(n, num_kv_heads, HEAD_DIM), self._randn(n, num_kv_heads, HEAD_DIM), blocks)
            )
        shape = (num_blocks, self.bs, num_kv_heads, HEAD_DIM)
        # Stale but finite contents: anything read without being masked would change the result.
        self.key_cache = self._randn(*shape).to(case.device, case.dtype)
        self.value_cache = self._randn(*shape).to(case.device, case.dtype)
        self.scale = HEAD_DIM**-0.5
        if backend_cls is None:
            backend_cls = get_attn_backend(case.backend, case.device, case.dtype, self.bs)
        self.window, self.cap = sliding_window, logits_soft_cap
        self.backend: AttentionBackend = backend_cls(
            num_heads,
            num_kv_heads,
            HEAD_DIM,
            self.scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def prefill_context(self, seq_idx: int, n: int) -> None:
        """Put the first n tokens of a sequence into the cache directly (as if earlier steps wrote them)."""
        s = self.seqs[seq_idx]
        slots = torch.tensor([s.blocks[p // self.bs] * self.bs + p % self.bs for p in range(n)])
        kc = self.key_cache.view(-1, self.num_kv_heads, HEAD_DIM)
        vc = self.value_cache.view(-1, self.num_kv_heads, HEAD_DIM)
        kc[slots.to(self.case.device)] = s.k[:n].to(kc)
        vc[slots.to(self.case.device)] = s.v[:n].to(vc)
        s.computed = n

    def step(self, schedule: list[tuple[int, int]]) -> None:
        """Run one batch of (seq index, new tokens); decode rows (1 token) must come first.

        Checks the backend output against the reference and the cache contents at the new slots.
        """
        dev, dtype = self.case.device, self.case.dtype
        q_lens = [n for _, n in schedule]
        num_decodes = 0
        while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
            num_decodes += 1
        assert all(n > 1 for n in q_lens[num_decodes:]), "decode rows first"
        num_tokens = sum(q_lens)
        hq, hkv = self.num_heads, self.num_kv_heads
        # Queries/keys/values as views into one fused projection, like the model produces them.
        fused = self._randn(num_tokens, (hq + 2 * hkv) * HEAD_DIM)
        q_all = fused[:, : hq * HEAD_DIM].view(num_tokens, hq, HEAD_DIM)
        new_k, new_v, slots, seq_lens, tables, refs = [], [], [], [], [], []
        t = 0
        for idx, n in schedule:
            s = self.seqs[idx]
            lo, hi = s.computed, s.computed + n
            new_k.append(s.k[lo:hi])
            new_v.append(s.v[lo:hi])
            slots += [s.blocks[p // self.bs] * self.bs + p % self.bs for p in range(lo, hi)]
            seq_lens.append(hi)
            tables.append(s.blocks[: math.ceil(hi / self.bs)])
            refs.append(naive_attention(q_all[t : t + n], s.k[:hi], s.v[:hi], self.scale, self.window, self.cap))
            t += n
            s.computed = hi
        fused[:, hq * HEAD_DIM : (hq + hkv) * HEAD_DIM] = torch.cat(new_k).view(num_tokens, -1)
        fused[:, (hq + hkv) * HEAD_DIM :] = torch.cat(new_v).view(num_tokens, -1)
        fused_dev = fused.to(dev, dtype)
        query = fused_dev[:, : hq * HEAD_DIM].view(num_tokens, hq, HEAD_DIM)
        key = fused_dev[:, hq * HEAD_DIM : (hq + hkv) * HEAD_DIM].view(num_tokens, hkv, HEAD_DIM)
        value = fused_dev[:, (hq + hkv) * HEAD_DIM :].view(num_tokens, hkv, HEAD_DIM)
        width = max(len(b) for b in tables)
        block_tables = torch.tensor([b + [0] * (width - len(b)) for b in tables], dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
        )
        out = self.backend.forward(query, key, value, self.key_cache, self.value_cache, meta)

        assert out.shape == (num_tokens, hq, HEAD_DIM)
        torch.testing.assert_close(out.float().cpu(), torch.cat(refs), atol=self.case.atol, rtol=1e-3)
        slot_t = torch.tensor(slots, device=dev)
        kc = self.key_cache.view(-1, hkv, HEAD_DIM)[slot_t].cpu()
        vc = self.value_cache.view(-1, hkv, HEAD_DIM)[slot_t].cpu()
        assert torch.equal(kc, key.cpu()) and torch.equal(vc, value.cpu())


# ---------------------------------------------------------------- backends vs reference


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", CASES)
def test_pure_prefill(case: Case, heads: tuple[int, int]) -> None:
    lens = [37, 5, 64, 18]
    h = Harness(case, *heads, lens)
    h.step([(i, n) for i, n in enumerate(lens)])


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", CASES)
def test_pure_decode(case: Case, heads: tuple[int, int]) -> None:
    contexts = [1, 16, 33, 70, 9]
    h = Harness(case, *heads, [c + 2 for c in contexts], seed=1)
    for i, c in enumerate(contexts):
        h.prefill_context(i, c)
    h.step([(i, 1) for i in range(len(contexts))])
    h.step([(i, 1) for i in range(len(contexts))])  # a second decode reads the first one's token


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", CASES)
def test_mixed_batch(case: Case, heads: tuple[int, int]) -> None:
    # rows 0-2 decode, row 3 a fresh prompt, row 4 a chunk on cached context
    h = Harness(case, *heads, [20, 48, 3, 29, 60], seed=2)
    for i, c in ((0, 19), (1, 47), (2, 2), (4, 25)):
        h.prefill_context(i, c)
    h.step([(0, 1), (1, 1), (2, 1), (3, 29), (4, 35)])


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", CASES)
def test_chunked_prefill_then_decode(case: Case, heads: tuple[int, int]) -> None:
    """All context comes from earlier forward calls: chunks, then decodes mixed with a new prompt."""
    h = Harness(case, *heads, [51, 25, 12], seed=3)
    h.step([(0, 21), (1, 7)])  # first chunks (fresh)
    h.step([(0, 17), (1, 16)])  # second chunks on cached context; row 1 finishes its prompt
    h.step([(1, 1), (0, 12), (2, 11)])  # decode + last chunk + a new prompt
    h.step([(0, 1), (1, 1), (2, 1)])


@pytest.mark.parametrize(
    ("window", "cap"), [(1, None), (6, None), (None, 2.0), (9, 2.0)], ids=["w1", "w6", "cap2", "w9-cap2"]
)
@pytest.mark.parametrize("case", CASES)
def test_sliding_window_and_soft_cap(case: Case, window: int | None, cap: float | None) -> None:
    """Decodes, chunks on cached context and fresh prompts, the windows shorter than most contexts."""
    backend_cls = get_attn_backend(case.backend, case.device, case.dtype, case.block_size)
    if cap is not None and not backend_cls.supports_logits_soft_cap:
        pytest.skip(f"{case.backend} refuses logits_soft_cap (tested in test_xformers_backend_glue_window)")
    h = Harness(case, 8, 2, [21, 49, 4, 30, 61], seed=6, sliding_window=window, logits_soft_cap=cap)
    for i, c in ((0, 19), (1, 47), (2, 2), (4, 25)):
        h.prefill_context(i, c)
    h.step([(0, 1), (1, 1), (2, 1), (3, 29), (4, 35)])
    h.step([(i, 1) for i in range(5)])


def test_single_long_decode_chunks_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows split into several gather chunks give the same answer."""
    import ops.attention.torch_backend as tb

    monkeypatch.setattr(tb, "_MAX_GATHER_BYTES", 1)  # one row per chunk
    case = Case("torch", "cpu", torch.float32, 4, 1e-5)
    h = Harness(case, 8, 2, [10, 30, 7], seed=4)
    for i, c in enumerate((9, 29, 6)):
        h.prefill_context(i, c)
    h.step([(0, 1), (1, 1), (2, 1)])


def test_decode_inside_then_outside_inference_mode() -> None:
    """The CPU gather workspace is per thread: a buffer made under inference_mode (an engine step) must
    not break a later decode outside it (the tests, profiling) in the same thread, nor the other way round."""
    case = Case("torch", "cpu", torch.float32, 4, 1e-5)
    h = Harness(case, 8, 2, [12, 12], seed=5)
    for i in range(2):
        h.prefill_context(i, 9)
    with torch.inference_mode():
        h.step([(0, 1), (1, 1)])
    h.step([(0, 1), (1, 1)])
    with torch.inference_mode():
        h.step([(0, 1), (1, 1)])


def test_flash_attn_block_size_constraint() -> None:
    from ops.attention.flash_attn_backend import check_flash_attn_block_size

    check_flash_attn_block_size(512)
    with pytest.raises(ValueError, match="multiple of 256"):
        check_flash_attn_block_size(16)


# ---------------------------------------------------------------- CUDA backends' glue, on CPU
# The flash-attn / xformers kernels need a GPU; these tests swap in small torch emulations of the
# two library calls (semantics as documented by each library) to check everything around them:
# cache writes, slot gathering, cu_seqlens, GQA layouts, mask choice, output shapes.


def _flash_window_and_cap(window_size: tuple[int, int], softcap: float) -> tuple[int | None, float | None]:
    """flash-attn's (left, right) window (-1: unbounded) and softcap (0: off) as naive_attention's options."""
    left, right = window_size
    assert right in (-1, 0), "a causal call sees no key after the query"
    return (left + 1 if left >= 0 else None), (softcap if softcap > 0 else None)


def _emulated_flash_attn(version: str = "2.6.3") -> types.ModuleType:
    def varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        softmax_scale,
        causal,
        block_table,
        window_size=(-1, -1),
        softcap=0.0,
    ):
        assert causal and block_table.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        window, cap = _flash_window_and_cap(window_size, softcap)
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        out = torch.empty_like(q)
        for b in range(len(cu_q) - 1):
            q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            assert q_len <= max_seqlen_q and k_len <= max_seqlen_k
            keys = k[block_table[b].long()].flatten(0, 1)[:k_len]
            vals = v[block_table[b].long()].flatten(0, 1)[:k_len]
            out[cu_q[b] : cu_q[b + 1]] = naive_attention(
                q[cu_q[b] : cu_q[b + 1]], keys, vals, softmax_scale, window, cap
            ).to(q)
        return out

    def with_kvcache(
        q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal, window_size=(-1, -1), softcap=0.0
    ):
        assert causal and q.shape[1] == 1
        window, cap = _flash_window_and_cap(window_size, softcap)
        out = torch.empty_like(q)
        for b, k_len in enumerate(cache_seqlens.tolist()):
            keys = k_cache[block_table[b].long()].flatten(0, 1)[:k_len]
            vals = v_cache[block_table[b].long()].flatten(0, 1)[:k_len]
            out[b] = naive_attention(q[b], keys, vals, softmax_scale, window, cap).to(q)
        return out

    mod = types.ModuleType("flash_attn")
    mod.__version__ = version  # type: ignore[attr-defined]
    mod.flash_attn_varlen_func = varlen  # type: ignore[attr-defined]
    mod.flash_attn_with_kvcache = with_kvcache  # type: ignore[attr-defined]
    return mod


def _emulated_xformers_ops() -> types.ModuleType:
    @dataclass
    class BottomRightMask:
        q_seqlen: list[int]
        kv_seqlen: list[int]
        window: int | None = None  # make_local_attention_from_bottomright: query at p sees p - window < k <= p

    class BlockDiagonalMask:
        def __init__(self, q_seqlen: list[int], kv_seqlen: list[int]) -> None:
            self.q_seqlen, self.kv_seqlen = q_seqlen, kv_seqlen

        @classmethod
        def from_seqlens(cls, q_seqlen: list[int], kv_seqlen: list[int]) -> BlockDiagonalMask:
            return cls(q_seqlen, kv_seqlen)

        def make_causal_from_bottomright(self) -> BottomRightMask:
            return BottomRightMask(self.q_seqlen, self.kv_seqlen)

        def make_local_attention_from_bottomright(self, window_size: int) -> BottomRightMask:
            return BottomRightMask(self.q_seqlen, self.kv_seqlen, window_size)

    def forward(q, k, v, *, attn_bias, scale):
        assert q.shape[0] == 1 and isinstance(attn_bias, BottomRightMask)
        q_shape = q.shape
        if q.dim() == 5:  # [1, M, G, H, K] with K/V expanded over H
            assert k.stride(3) == 0, "K/V must be expanded, not repeated"
            q, k, v = q.flatten(2, 3), k[:, :, :, 0], v[:, :, :, 0]  # back to [1, M, heads, K]
        out = torch.empty_like(q[0])
        qs = ks = 0
        for q_len, k_len in zip(attn_bias.q_seqlen, attn_bias.kv_seqlen, strict=True):
            out[qs : qs + q_len] = naive_attention(
                q[0, qs : qs + q_len], k[0, ks : ks + k_len], v[0, ks : ks + k_len], scale, attn_bias.window
            )
            qs, ks = qs + q_len, ks + k_len
        return out.view(q_shape)

    fmha = types.SimpleNamespace(
        attn_bias=types.SimpleNamespace(BlockDiagonalMask=BlockDiagonalMask),
        memory_efficient_attention_forward=forward,
    )
    mod = types.ModuleType("xformers.ops")
    mod.fmha = fmha  # type: ignore[attr-defined]
    return mod


def _run_scenarios(
    case: Case, backend_cls: type[AttentionBackend], window: int | None = None, cap: float | None = None
) -> None:
    for heads in ((8, 2), (4, 4)):
        h = Harness(
            case,
            *heads,
            [21, 49, 4, 30, 61],
            seed=2,
            backend_cls=backend_cls,
            sliding_window=window,
            logits_soft_cap=cap,
        )
        for i, c in ((0, 19), (1, 47), (2, 2), (4, 25)):
            h.prefill_context(i, c)
        h.step([(0, 1), (1, 1), (2, 1), (3, 29), (4, 35)])  # mixed
        h.step([(i, 1) for i in range(5)])  # pure decode


def test_flash_attn_backend_glue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", _emulated_flash_attn())
    from ops.attention.flash_attn_backend import FlashAttnBackend

    _run_scenarios(Case("flash_attn", "cpu", torch.float16, 256, 2e-3), FlashAttnBackend)
    h = Harness(Case("flash_attn", "cpu", torch.float16, 16, 2e-3), 4, 4, [8], backend_cls=FlashAttnBackend)
    with pytest.raises(ValueError, match="multiple of 256"):
        h.step([(0, 8)])


@pytest.mark.parametrize("block_size", [16, 4])
def test_xformers_backend_glue(monkeypatch: pytest.MonkeyPatch, block_size: int) -> None:
    monkeypatch.setitem(sys.modules, "xformers", types.ModuleType("xformers"))
    monkeypatch.setitem(sys.modules, "xformers.ops", _emulated_xformers_ops())
    from ops.attention.xformers_backend import XFormersBackend

    _run_scenarios(Case("xformers", "cpu", torch.float32, block_size, 1e-5), XFormersBackend)


@pytest.mark.parametrize(("window", "cap"), [(1, None), (7, None), (None, 3.0), (5, 2.0)])
def test_flash_attn_backend_glue_window_and_soft_cap(
    monkeypatch: pytest.MonkeyPatch, window: int | None, cap: float | None
) -> None:
    """The emulation applies flash-attn's window_size / softcap as the library does: the backend's
    translation of sliding_window / logits_soft_cap into them is what is checked."""
    monkeypatch.setitem(sys.modules, "flash_attn", _emulated_flash_attn())
    from ops.attention.flash_attn_backend import FlashAttnBackend

    _run_scenarios(Case("flash_attn", "cpu", torch.float16, 256, 2e-3), FlashAttnBackend, window, cap)


def test_flash_attn_before_2_6_refuses_window_and_soft_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", _emulated_flash_attn("2.5.9"))
    from ops.attention.flash_attn_backend import FlashAttnBackend

    FlashAttnBackend(8, 2, 32, 0.1)  # neither option: any 2.x
    with pytest.raises(ValueError, match=r"flash-attn>=2.6 .*found 2.5.9"):
        FlashAttnBackend(8, 2, 32, 0.1, sliding_window=8)


@pytest.mark.parametrize("window", [1, 7, 100])
def test_xformers_backend_glue_window(monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    monkeypatch.setitem(sys.modules, "xformers", types.ModuleType("xformers"))
    monkeypatch.setitem(sys.modules, "xformers.ops", _emulated_xformers_ops())
    from ops.attention.xformers_backend import XFormersBackend

    _run_scenarios(Case("xformers", "cpu", torch.float32, 16, 1e-5), XFormersBackend, window)
    with pytest.raises(ValueError, match="'xformers' does not implement attention logit soft-capping"):
        XFormersBackend(8, 2, HEAD_DIM, 0.1, sliding_window=window, logits_soft_cap=30.0)


def test_xformers_windowed_and_full_layers_share_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of one step with different windows (Gemma 2 alternates) each get their own cached plan."""
    monkeypatch.setitem(sys.modules, "xformers", types.ModuleType("xformers"))
    monkeypatch.setitem(sys.modules, "xformers.ops", _emulated_xformers_ops())
    from ops.attention.torch_backend import TorchAttentionBackend
    from ops.attention.xformers_backend import XFormersBackend

    h = Harness(Case("torch", "cpu", torch.float32, 16, 1e-5), 8, 2, [40, 9], seed=7)
    h.prefill_context(0, 30)
    gen = torch.Generator().manual_seed(7)
    rows = [(0, 30, 10), (1, 0, 9)]  # (seq, cached, new)
    query = torch.randn(19, 8, HEAD_DIM, generator=gen)
    key, value = torch.randn(19, 2, HEAD_DIM, generator=gen), torch.randn(19, 2, HEAD_DIM, generator=gen)
    tables = [h.seqs[i].blocks + [0] * (3 - len(h.seqs[i].blocks)) for i, _, _ in rows]
    slots = [h.seqs[i].blocks[p // 16] * 16 + p % 16 for i, c, n in rows for p in range(c, c + n)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 10, 19], dtype=torch.int32),
        seq_lens=torch.tensor([40, 9], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        max_query_len=10,
        max_seq_len=40,
    )
    for window in (None, 4, None, 12, 4):
        expected = TorchAttentionBackend(8, 2, HEAD_DIM, 0.1, sliding_window=window).forward(
            query, key, value, h.key_cache, h.value_cache, meta
        )
        out = XFormersBackend(8, 2, HEAD_DIM, 0.1, sliding_window=window).forward(
            query, key, value, h.key_cache, h.value_cache, meta
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- registry


def test_registry_names() -> None:
    assert ATTENTION_BACKENDS == ("auto", "torch", "cpu", "triton", "flash_attn", "xformers")


@NEEDS_CPU_KERNEL
def test_auto_on_cpu_is_the_kernel_for_float32_only() -> None:
    assert get_attn_backend("auto", torch.device("cpu"), torch.float32).name == "cpu"
    assert get_attn_backend("auto", "cpu", torch.bfloat16).name == "torch"
    assert get_attn_backend("auto", "cpu").name == "torch"  # dtype unknown: never a backend that may refuse it
    assert get_attn_backend("torch", "cpu").name == "torch"


def test_auto_on_cpu_falls_back_to_torch_when_the_kernel_cannot_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from ops.attention import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load_error", lambda: "no compiler")
    assert get_attn_backend("auto", "cpu", torch.float32).name == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot be used: no compiler"):
        get_attn_backend("cpu", "cpu", torch.float32)


def test_cpu_backend_refuses_other_devices_and_dtypes() -> None:
    with pytest.raises(ValueError, match="float32 only"):
        get_attn_backend("cpu", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="only on the CPU"):
        get_attn_backend("cpu", "cuda", torch.float32)


def test_unknown_backend_name() -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of .*got 'x'"):
        get_attn_backend("x", "cpu")


@pytest.mark.parametrize("name", ["triton", "flash_attn", "xformers"])
def test_cuda_backend_on_cpu_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"attention_backend='{name}'.*CUDA"):
        get_attn_backend(name, torch.device("cpu"), torch.float16, 256)


@NEEDS_CUDA
def test_flash_attn_refuses_bad_dtype_or_block_size() -> None:
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (pip install flash-attn>=2.6)")
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        get_attn_backend("flash_attn", "cuda", torch.float32, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        get_attn_backend("flash_attn", "cuda", torch.float16, 16)
    assert get_attn_backend("auto", "cuda", torch.float16, 16).name != "flash_attn"
