"""KV-cache ops move exactly the named slots/blocks and nothing else."""

from __future__ import annotations

import pytest
import torch

from ops.cache_ops import copy_blocks, swap_blocks, write_to_paged_cache

SHAPE = (10, 4, 2, 8)  # [num_blocks, block_size, kv_heads, head_dim]


def _caches(
    num_layers: int, seed: int, num_blocks: int = SHAPE[0]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, *SHAPE[1:])
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(num_layers)]


def _clone(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in caches]


def test_write_to_paged_cache_writes_only_the_slots() -> None:
    ((kc, vc),) = _caches(1, 0)
    before_k, before_v = kc.clone(), vc.clone()
    slots = torch.tensor([0, 5, 39, 17, 22])  # scattered over blocks 0, 1, 9, 4, 5
    key = torch.randn(5, 2, 8)
    value = torch.randn(5, 2, 8)
    write_to_paged_cache(key, value, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, 2, 8), vc.view(-1, 2, 8)
    assert torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], value)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, 8)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, 2, 8)[untouched])


def test_write_accepts_strided_views() -> None:
    ((kc, vc),) = _caches(1, 1)
    fused = torch.randn(3, 2 * 16)  # k and v as column slices of one projection
    key, value = fused[:, :16].view(3, 2, 8), fused[:, 16:].view(3, 2, 8)
    write_to_paged_cache(key, value, kc, vc, torch.tensor([1, 2, 3]))
    assert torch.equal(kc.view(-1, 2, 8)[1:4], key) and torch.equal(vc.view(-1, 2, 8)[1:4], value)


def test_write_of_a_prefill_chunk_and_of_other_layouts_matches_index_copy() -> None:
    """A long chunk (the C++ copy splits it over threads), a layout it does not take (heads not side by
    side: the torch path), bf16: all equal index_copy_ into the flat cache."""
    g = torch.Generator().manual_seed(7)
    cases = ((torch.float32, 600, False), (torch.float32, 9, True), (torch.bfloat16, 9, False))
    for dtype, tokens, transposed in cases:
        kc, vc = torch.zeros(200, 4, 2, 8, dtype=dtype), torch.zeros(200, 4, 2, 8, dtype=dtype)
        slots = torch.randperm(800, generator=g)[:tokens]
        key, value = torch.randn(tokens, 2, 8, generator=g).to(dtype), torch.randn(tokens, 2, 8, generator=g).to(dtype)
        if transposed:
            key = key.transpose(0, 1).contiguous().transpose(0, 1)
            value = value.transpose(0, 1).contiguous().transpose(0, 1)
        write_to_paged_cache(key, value, kc, vc, slots)
        expected_k = torch.zeros(800, 2, 8, dtype=dtype).index_copy_(0, slots, key)
        expected_v = torch.zeros(800, 2, 8, dtype=dtype).index_copy_(0, slots, value)
        assert torch.equal(kc.view(-1, 2, 8), expected_k) and torch.equal(vc.view(-1, 2, 8), expected_v)


def test_write_refuses_a_slot_outside_the_cache() -> None:
    ((kc, vc),) = _caches(1, 3)
    before = kc.clone()
    with pytest.raises((IndexError, RuntimeError)):
        write_to_paged_cache(torch.randn(2, 2, 8), torch.randn(2, 2, 8), kc, vc, torch.tensor([3, 40]))
    assert torch.equal(kc, before)  # checked before anything is written


def test_copy_blocks_moves_exactly_the_pairs() -> None:
    caches = _caches(3, 2)
    before = _clone(caches)
    pairs = [(1, 7), (4, 2), (1, 8)]  # one source fanned out to two destinations
    copy_blocks(caches, pairs)
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        for src, dst in pairs:
            assert torch.equal(k[dst], k0[src]) and torch.equal(v[dst], v0[src])
        rest = [b for b in range(SHAPE[0]) if b not in {7, 2, 8}]
        assert torch.equal(k[rest], k0[rest]) and torch.equal(v[rest], v0[rest])


def test_copy_blocks_reads_sources_before_writing() -> None:
    caches = _caches(1, 3)
    before = _clone(caches)
    copy_blocks(caches, [(0, 1), (1, 0)])  # a swap of two blocks
    (k, v), (k0, v0) = caches[0], before[0]
    assert torch.equal(k[0], k0[1]) and torch.equal(k[1], k0[0])
    assert torch.equal(v[0], v0[1]) and torch.equal(v[1], v0[0])


def test_copy_blocks_empty_is_noop() -> None:
    caches = _caches(2, 4)
    before = _clone(caches)
    copy_blocks(caches, [])
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(caches, before, strict=True))


@pytest.mark.parametrize(
    "dst_device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
        ),
    ],
)
def test_swap_blocks_moves_exactly_the_pairs(dst_device: str) -> None:
    src = _caches(2, 5)
    dst = [(k.to(dst_device), v.to(dst_device)) for k, v in _caches(2, 6, num_blocks=6)]
    src_before, dst_before = _clone(src), [(k.cpu(), v.cpu()) for k, v in dst]
    pairs = [(9, 0), (3, 5), (0, 2)]
    swap_blocks(src, dst, pairs)
    for (sk, sv), (sk0, sv0), (dk, dv), (dk0, dv0) in zip(src, src_before, dst, dst_before, strict=True):
        assert torch.equal(sk, sk0) and torch.equal(sv, sv0)  # the source is only read
        dk, dv = dk.cpu(), dv.cpu()
        for s, d in pairs:
            assert torch.equal(dk[d], sk0[s]) and torch.equal(dv[d], sv0[s])
        rest = [1, 3, 4]
        assert torch.equal(dk[rest], dk0[rest]) and torch.equal(dv[rest], dv0[rest])


def test_swap_blocks_layer_count_mismatch() -> None:
    with pytest.raises(ValueError, match="layers"):
        swap_blocks(_caches(2, 7), _caches(3, 8), [(0, 0)])
