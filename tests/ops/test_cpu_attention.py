"""The C++ CPU decode kernel against the torch backend (the reference) on random paged layouts.

Shapes like the models we serve (SmolLM2: 9 query / 3 KV heads, head_dim 64), ragged context
lengths from 1 to several blocks, blocks scattered over a pool filled with random values, block
sizes 16 and 32; few rows (split per KV head) and many rows (one work item per row); MHA and GQA.
Sliding windows (shorter and longer than the contexts, 1) and logit soft-capping, with the cache
slots before each row's window poisoned with NaN: the kernel must not read them at all.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from ops.attention.base import AttentionMetadata, StepKV
from ops.attention.torch_backend import TorchAttentionBackend
from tests.helpers.isa import needs_avx512, rerun_on_avx2


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    from ops.attention import cpu_kernels

    error = cpu_kernels.load_error()
    if error is not None:
        pytest.skip(error)
    return cpu_kernels


def _random_paged_decode(
    gen: torch.Generator, lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    num_heads, num_kv_heads = heads
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + 7
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need) + 2  # wider than any row needs: tail entries must never be read
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for row, n in enumerate(need):
        tables[row, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        max_query_len=1,
        max_seq_len=max(lens),
        num_decodes=len(lens),
    )
    return query, key_cache, value_cache, meta


def _cached(key_cache: torch.Tensor, value_cache: torch.Tensor) -> StepKV:
    """A decode step's K/V as the reference's `_decode` reads them: everything already in the cache."""
    no_new = key_cache.new_empty(0, *key_cache.shape[2:])
    return StepKV(no_new, no_new, key_cache, value_cache)


def _assert_kernel_matches_reference(
    kernels: ModuleType,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
    cap: float | None = None,
) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    options = {"sliding_window": window, "logits_soft_cap": cap}
    reference = TorchAttentionBackend(num_heads, key_cache.shape[2], head_dim, head_dim**-0.5, **options)
    expected = torch.empty_like(query)
    reference._decode(query, _cached(key_cache, value_cache), meta, expected)
    if window is not None:  # (the reference reads and masks them; NaN would spread through its matmul)
        key_cache, value_cache = _poison_before_window(key_cache, value_cache, meta, window)
    out = torch.full_like(query, float("nan"))
    kernels.paged_decode_attention(
        query, key_cache, value_cache, meta.block_tables, meta.seq_lens, head_dim**-0.5, out, **options
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def _poison_before_window(
    key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with NaN in every slot before each decode row's window (positions
    < seq_len - window): a kernel that reads one, masked or not, returns NaN."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    block_size = key_cache.shape[1]
    tables = meta.block_tables.tolist()
    slots = [
        tables[row][pos // block_size] * block_size + pos % block_size
        for row, seq_len in enumerate(meta.seq_lens.tolist())
        for pos in range(max(0, seq_len - window))
    ]
    for cache in (key_cache, value_cache):
        cache.view(-1, *cache.shape[2:])[torch.tensor(slots, dtype=torch.long)] = float("nan")
    return key_cache, value_cache


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa9x3", "mha4", "mqa8"])
# (rows, longest context in blocks): short calls run on one thread; long ones in parallel, split per
# KV head when rows are few (2 rows) and per row when they are many (24 rows).
@pytest.mark.parametrize(
    ("num_rows", "max_blocks"),
    [(1, 5), (3, 5), (40, 5), (2, 80), (24, 25)],
    ids=["1row", "3rows", "40rows", "2rows-long-parallel", "24rows-parallel"],
)
def test_decode_kernel_matches_torch_reference(
    kernels: ModuleType, block_size: int, heads: tuple[int, int], num_rows: int, max_blocks: int
) -> None:
    gen = torch.Generator().manual_seed(block_size * 1000 + num_rows)
    lens = torch.randint(max_blocks * block_size // 2, max_blocks * block_size, (num_rows,), generator=gen).tolist()
    lens[0] = 1  # a context of one token: softmax over a single key
    query, key_cache, value_cache, meta = _random_paged_decode(gen, lens, heads, 64, block_size)
    _assert_kernel_matches_reference(kernels, query, key_cache, value_cache, meta)


# The AVX2 path takes head_dim in steps of 16 with an 8-wide tail and query heads in groups of up to
# 4 per KV head; a head_dim that is not a multiple of 8 takes the scalar path.
@pytest.mark.parametrize(
    ("heads", "head_dim"),
    [((10, 2), 40), ((8, 4), 128), ((7, 1), 24), ((6, 3), 36)],
    ids=["group5-d40", "group2-d128", "group7-d24", "scalar-d36"],
)
@pytest.mark.parametrize("num_rows", [2, 24])
def test_decode_kernel_other_head_shapes(
    kernels: ModuleType, heads: tuple[int, int], head_dim: int, num_rows: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim * 100 + num_rows)
    lens = torch.randint(1, 40 * 16, (num_rows,), generator=gen).tolist()
    query, key_cache, value_cache, meta = _random_paged_decode(gen, lens, heads, head_dim, 16)
    _assert_kernel_matches_reference(kernels, query, key_cache, value_cache, meta)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize(
    ("window", "cap"),
    [(1, None), (7, None), (200, None), (2**40, None), (None, 5.0), (37, 2.0)],
    ids=["w1", "w7", "w200", "w-past-contexts", "cap5", "w37-cap2"],
)
# 2 long rows: one work item per KV head, in parallel; 30 rows: one item per row.
@pytest.mark.parametrize("num_rows", [2, 30])
def test_decode_kernel_window_and_soft_cap(
    kernels: ModuleType, block_size: int, window: int | None, cap: float | None, num_rows: int
) -> None:
    gen = torch.Generator().manual_seed(block_size + num_rows)
    lens = torch.randint(1, 1300, (num_rows,), generator=gen).tolist()
    lens[0], lens[-1] = 1, 1297  # a single key; a window starting mid-block far into the context
    query, key_cache, value_cache, meta = _random_paged_decode(gen, lens, (9, 3), 64, block_size)
    _assert_kernel_matches_reference(kernels, query * 3.0, key_cache, value_cache, meta, window, cap)


@pytest.mark.parametrize(
    ("heads", "head_dim"), [((10, 2), 40), ((6, 3), 36)], ids=["group5-d40", "scalar-d36"]
)
def test_decode_kernel_window_and_soft_cap_other_head_shapes(
    kernels: ModuleType, heads: tuple[int, int], head_dim: int
) -> None:
    """The AVX2 soft-cap's scalar tail (a row of 37 % 8 keys) and the portable loops' window and cap."""
    gen = torch.Generator().manual_seed(head_dim)
    query, key_cache, value_cache, meta = _random_paged_decode(gen, [1, 30, 70, 301], heads, head_dim, 16)
    _assert_kernel_matches_reference(kernels, query * 3.0, key_cache, value_cache, meta, 37, 2.0)


def test_decode_kernel_softmax_of_widely_spread_scores(kernels: ModuleType) -> None:
    """Scores far below the row's maximum get a weight of (about) 0 (the vectorised exp clamps its
    input at -87.3), and a row whose scores are all equal averages its values."""
    gen = torch.Generator().manual_seed(11)
    query, key_cache, value_cache, meta = _random_paged_decode(gen, [300, 70], (9, 3), 64, 16)
    query = query * 40.0  # scores spread over thousands: most weights are exactly 0
    expected = torch.empty_like(query)
    TorchAttentionBackend(9, 3, 64, 0.125)._decode(query, _cached(key_cache, value_cache), meta, expected)
    out = torch.empty_like(query)
    kernels.paged_decode_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, 0.125, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    zero = torch.zeros_like(query)
    kernels.paged_decode_attention(zero, key_cache, value_cache, meta.block_tables, meta.seq_lens, 0.125, out)
    table = meta.block_tables[1].long()
    values = value_cache[table].flatten(0, 1)[:70]  # row 1's 70 cached values [70, 3, 64]
    mean = values.mean(0).repeat_interleave(3, dim=0)
    torch.testing.assert_close(out[1], mean, atol=1e-5, rtol=1e-4)


def test_decode_kernel_reads_strided_query_and_writes_a_slice(kernels: ModuleType) -> None:
    """Queries come as a view into the fused QKV projection; the output is a slice of the step's output."""
    gen = torch.Generator().manual_seed(7)
    lens = [5, 37, 16]
    _, key_cache, value_cache, meta = _random_paged_decode(gen, lens, (9, 3), 64, 16)
    fused = torch.randn(len(lens), (9 + 2 * 3) * 64, generator=gen)
    query = fused[:, : 9 * 64].view(len(lens), 9, 64)
    expected = torch.empty(len(lens), 9, 64)
    TorchAttentionBackend(9, 3, 64, 0.125)._decode(query, _cached(key_cache, value_cache), meta, expected)
    whole = torch.zeros(len(lens) + 2, 9, 64)
    kernels.paged_decode_attention(
        query, key_cache, value_cache, meta.block_tables, meta.seq_lens, 0.125, whole[: len(lens)]
    )
    torch.testing.assert_close(whole[: len(lens)], expected, atol=1e-5, rtol=1e-4)
    assert torch.equal(whole[len(lens) :], torch.zeros(2, 9, 64))


def test_decode_kernel_refuses_bad_inputs(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(8)
    query, key_cache, value_cache, meta = _random_paged_decode(gen, [20], (4, 2), 32, 16)
    out = torch.empty_like(query)
    call = kernels.paged_decode_attention
    with pytest.raises(RuntimeError, match="float32"):
        call(query.double(), key_cache, value_cache, meta.block_tables, meta.seq_lens, 1.0, out.double())
    with pytest.raises(RuntimeError, match="int32"):
        call(query, key_cache, value_cache, meta.block_tables.long(), meta.seq_lens, 1.0, out)
    too_long = torch.tensor([meta.block_tables.shape[1] * 16 + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="seq_len out of the block table's range"):
        call(query, key_cache, value_cache, meta.block_tables, too_long, 1.0, out)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        call(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, 1.0, out, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap must be positive"):
        call(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, 1.0, out, logits_soft_cap=-1.0)


def test_a_lock_left_by_a_killed_loader_does_not_hang_the_next(kernels: ModuleType) -> None:
    """A process killed inside torch's `load()` leaves torch's `lock` file behind (a Ray worker killed
    while starting); the next process must still load the kernels, not wait for that file forever."""
    import subprocess
    import sys

    stale = kernels.build_directory(kernels.build_name()) / "lock"
    stale.touch()
    probe = "from ops.attention import cpu_kernels; print(cpu_kernels.load_error())"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a stale torch lock file made the kernel load wait (it waits forever)")
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-2000:]


@needs_avx512
def test_the_avx2_path_matches_too(kernels: ModuleType) -> None:
    """The cases above ran the decode kernel's AVX-512 loops (head_dims that are multiples of 16); this
    runs them on its AVX2 loops."""
    rerun_on_avx2(__file__, "test_the_avx2_path_matches_too")
