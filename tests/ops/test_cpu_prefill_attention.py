"""The C++ CPU prefill kernel against the torch backend (the reference) on random paged layouts.

Whole steps through both backends' `forward` (which first writes the step's keys and values into the
cache): decode rows first, then prefill rows with ragged query lengths, some on top of cached
context (chunked prefill, prefix-cache hits) that spans scattered blocks of a pool filled with
random values; block sizes 16 and 32; GQA, MHA and MQA; head_dims the AVX2 code takes in 32- and
8-float steps. Prompts longer than a query tile (16) and one key tile (16) exercise the online
softmax across tiles and the causal edge inside a tile. Sliding windows (1, inside a tile, across
tiles, longer than every context) and logit soft-capping, block sizes 16 and 128, with the cache
slots that no query's window reaches poisoned with NaN: the kernels must not read them at all.
"""

from __future__ import annotations

import math

import pytest
import torch

from ops.attention.base import AttentionMetadata
from ops.attention.torch_backend import TorchAttentionBackend
from tests.helpers.isa import needs_avx512, rerun_on_avx2


def _kernel_error() -> str | None:
    from ops.attention import cpu_kernels

    error = cpu_kernels.load_error()
    if error is None and not cpu_kernels.vectorized():
        return "the kernels are the portable build; the prefill kernel is AVX2 code"
    return error


pytestmark = pytest.mark.skipif(_kernel_error() is not None, reason=str(_kernel_error()))


def _step(
    gen: torch.Generator, rows: list[tuple[int, int]], heads: tuple[int, int], head_dim: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """rows: (new tokens, cached tokens) per row, decodes (1, n) first. Returns q, k, v, caches, meta."""
    num_heads, num_kv_heads = heads
    need = [math.ceil((q + c) / block_size) for q, c in rows]
    num_blocks = sum(need) + 5
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(rows), max(need) + 1, dtype=torch.int32)  # the spare column is never read
    slots: list[int] = []
    for r, ((q_len, cached), n) in enumerate(zip(rows, need, strict=True)):
        tables[r, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        for pos in range(cached, cached + q_len):
            slots.append(int(tables[r, pos // block_size]) * block_size + pos % block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tokens = len(slots)
    starts = [0]
    for q_len, _ in rows:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([q + c for q, c in rows], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        max_query_len=max(q for q, _ in rows),
        max_seq_len=max(q + c for q, c in rows),
        num_decodes=sum(1 for q, c in rows if q == 1 and c > 0),
    )
    query = torch.randn(tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    return query, key, value, key_cache, value_cache, meta


def _assert_matches_reference(
    rows: list[tuple[int, int]],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    seed: int,
    window: int | None = None,
    cap: float | None = None,
) -> None:
    from ops.attention.cpu_backend import CpuAttentionBackend

    gen = torch.Generator().manual_seed(seed)
    query, key, value, key_cache, value_cache, meta = _step(gen, rows, heads, head_dim, block_size)
    if cap is not None:
        query = query * 3.0  # scores of a few units: tanh far from linear at caps of a few units
    scale = head_dim**-0.5
    options = {"sliding_window": window, "logits_soft_cap": cap}
    # The reference runs in float64: the float32 torch path was itself off by 5.4e-5 on a soft-capped
    # decode row in one CI run (a loaded machine, where torch's matmul took another route), while the
    # kernel stayed within 7e-7 of float64.
    expected = (
        TorchAttentionBackend(heads[0], heads[1], head_dim, scale, **options)
        .forward(query.double(), key.double(), value.double(), key_cache.double(), value_cache.double(), meta)
        .float()
    )
    if window is not None:
        _poison_outside_windows(key_cache, value_cache, rows, meta, window)
    kernel = CpuAttentionBackend(heads[0], heads[1], head_dim, scale, **options)
    assert kernel._prefill_kernel
    out = kernel.forward(query, key, value, key_cache, value_cache, meta)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def _poison_outside_windows(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: list[tuple[int, int]],
    meta: AttentionMetadata,
    window: int,
) -> None:
    """NaN in every cached slot before the window of its row's first query (position = cached tokens):
    no query of the row may attend it, so a kernel that reads one, masked or not, returns NaN."""
    block_size = key_cache.shape[1]
    tables = meta.block_tables.tolist()
    slots = [
        tables[r][pos // block_size] * block_size + pos % block_size
        for r, (_, cached) in enumerate(rows)
        for pos in range(max(0, cached - window + 1))
    ]
    for cache in (key_cache, value_cache):
        cache.view(-1, *cache.shape[2:])[torch.tensor(slots, dtype=torch.long)] = float("nan")


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa9x3", "mha4", "mqa8"])
@pytest.mark.parametrize(
    "rows",
    [
        [(1, 1), (2, 0), (17, 0), (100, 0)],  # fresh prompts: 1 token, within a tile, several tiles
        [(1, 40), (1, 7), (5, 60), (33, 16), (70, 129)],  # decodes, then chunks over cached context
        [(300, 0)],  # one long prompt: many query and key tiles, work spread over both threads
        [(16, 1000)],  # a short chunk at the end of a long context
    ],
    ids=["fresh", "mixed-chunked", "long", "chunk-on-long-context"],
)
def test_prefill_kernel_matches_torch_reference(
    block_size: int, heads: tuple[int, int], rows: list[tuple[int, int]]
) -> None:
    _assert_matches_reference(rows, heads, 64, block_size, seed=block_size * 31 + len(rows))


@pytest.mark.parametrize(
    ("heads", "head_dim"),
    [((10, 2), 40), ((8, 4), 128), ((7, 1), 24)],
    ids=["group5-d40", "group2-d128", "group7-d24"],
)
def test_prefill_kernel_other_head_shapes(heads: tuple[int, int], head_dim: int) -> None:
    _assert_matches_reference([(1, 9), (23, 0), (40, 37)], heads, head_dim, 16, seed=head_dim)


# Decodes, chunks over cached context (ending mid-block, longer than a query tile), a fresh prompt over
# several query and key tiles, a short chunk at the end of a long context.
_WINDOW_ROWS = [(1, 40), (1, 300), (5, 60), (33, 16), (70, 129), (150, 0), (16, 1000)]


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)], ids=["gqa9x3", "mqa8"])
@pytest.mark.parametrize(
    ("window", "cap"),
    [(1, None), (13, None), (48, None), (2**40, None), (None, 2.5), (13, 2.5), (100, 30.0)],
    ids=["w1", "w13", "w48", "w-past-contexts", "cap2.5", "w13-cap2.5", "w100-cap30"],
)
def test_prefill_kernel_window_and_soft_cap(
    block_size: int, heads: tuple[int, int], window: int | None, cap: float | None
) -> None:
    _assert_matches_reference(_WINDOW_ROWS, heads, 64, block_size, seed=block_size, window=window, cap=cap)


@pytest.mark.parametrize(("heads", "head_dim"), [((10, 2), 40), ((8, 4), 128)], ids=["group5-d40", "group2-d128"])
def test_prefill_kernel_window_and_soft_cap_other_head_shapes(heads: tuple[int, int], head_dim: int) -> None:
    _assert_matches_reference([(1, 9), (23, 0), (40, 37)], heads, head_dim, 16, seed=head_dim, window=21, cap=4.0)


def test_prefill_kernel_reads_a_strided_query() -> None:
    """Queries come as a view into the fused QKV projection."""
    from ops.attention import cpu_kernels

    gen = torch.Generator().manual_seed(3)
    rows = [(20, 0), (9, 30)]
    _, key, value, key_cache, value_cache, meta = _step(gen, rows, (9, 3), 64, 16)
    fused = torch.randn(meta.num_tokens, (9 + 2 * 3) * 64, generator=gen)
    query = fused[:, : 9 * 64].view(meta.num_tokens, 9, 64)
    expected = TorchAttentionBackend(9, 3, 64, 0.125).forward(query, key, value, key_cache, value_cache, meta)
    out = torch.empty(meta.num_tokens, 9, 64)  # the caches already hold this step's keys and values
    q_loc, lens, tables = meta.query_start_loc, meta.seq_lens, meta.block_tables
    cpu_kernels.paged_prefill_attention(query, key_cache, value_cache, tables, q_loc, lens, 0, 0.125, out)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_prefill_kernel_refuses_bad_inputs() -> None:
    from ops.attention import cpu_kernels

    gen = torch.Generator().manual_seed(4)
    query, _, _, key_cache, value_cache, meta = _step(gen, [(20, 0)], (4, 2), 32, 16)
    out = torch.empty_like(query)
    call = cpu_kernels.paged_prefill_attention
    q_loc, lens, tables = meta.query_start_loc, meta.seq_lens, meta.block_tables
    with pytest.raises(RuntimeError, match="fp32"):
        call(query.double(), key_cache, value_cache, tables, q_loc, lens, 0, 1.0, out.double())
    with pytest.raises(RuntimeError, match="int32"):
        call(query, key_cache, value_cache, tables.long(), q_loc, lens, 0, 1.0, out)
    too_long = torch.tensor([tables.shape[1] * 16 + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        call(query, key_cache, value_cache, tables, q_loc, too_long, 0, 1.0, out)


@needs_avx512
def test_the_avx2_path_matches_too() -> None:
    """The cases above ran the kernel's AVX-512 job; this runs them on its AVX2 job."""
    rerun_on_avx2(__file__, "test_the_avx2_path_matches_too")
