"""CacheEngine: shapes, sizing arithmetic, and swap/copy round trips that touch only the named blocks."""

from __future__ import annotations

import pytest
import torch

from model_exec.cache_engine import CacheEngine


def _engine(num_device_blocks: int = 8, num_cpu_blocks: int = 4) -> CacheEngine:
    return CacheEngine(
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        num_device_blocks=num_device_blocks,
        num_cpu_blocks=num_cpu_blocks,
        dtype=torch.float32,
        device="cpu",
    )


def _fill_random(engine: CacheEngine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for k, v in engine.device_caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))


def test_shapes_and_zeroed_device_pool() -> None:
    e = _engine()
    assert len(e.device_caches) == 3 and len(e.cpu_caches) == 3
    for k, v in e.device_caches:
        assert k.shape == v.shape == (8, 4, 2, 8)
        assert k.dtype == torch.float32 and k.device.type == "cpu"
        assert not k.any() and not v.any()  # masked reads of unwritten slots must see finite values
    for k, v in e.cpu_caches:
        assert k.shape == v.shape == (4, 4, 2, 8)


def test_bytes_per_block_and_budget() -> None:
    per_block = CacheEngine.bytes_per_block(30, 3, 64, 16, torch.bfloat16)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 2
    assert CacheEngine.num_blocks_for_budget(10 * per_block + per_block - 1, 30, 3, 64, 16, torch.bfloat16) == 10
    assert CacheEngine.num_blocks_for_budget(per_block - 1, 30, 3, 64, 16, torch.bfloat16) == 0
    assert CacheEngine.bytes_per_block(1, 1, 1, 1, torch.float32) == 8


def test_swap_out_then_in_round_trip() -> None:
    e = _engine()
    _fill_random(e, 0)
    original = [(k.clone(), v.clone()) for k, v in e.device_caches]
    e.swap_out([(5, 0), (2, 3)])
    for (ck, cv), (k0, v0) in zip(e.cpu_caches, original, strict=True):
        assert torch.equal(ck[0], k0[5]) and torch.equal(ck[3], k0[2])
        assert torch.equal(cv[0], v0[5]) and torch.equal(cv[3], v0[2])
    for k, _ in e.device_caches:  # the blocks are reused by someone else meanwhile
        k[5].zero_()
        k[2].zero_()
    e.swap_in([(0, 6), (3, 1)])  # back into different device blocks
    for (k, v), (k0, v0) in zip(e.device_caches, original, strict=True):
        assert torch.equal(k[6], k0[5]) and torch.equal(v[6], v0[5])
        assert torch.equal(k[1], k0[2]) and torch.equal(v[1], v0[2])
        for b in (0, 3, 4, 7):
            assert torch.equal(k[b], k0[b]) and torch.equal(v[b], v0[b])


def test_copy_on_write() -> None:
    e = _engine()
    _fill_random(e, 1)
    original = [(k.clone(), v.clone()) for k, v in e.device_caches]
    e.copy([(3, 7)])
    for (k, v), (k0, v0) in zip(e.device_caches, original, strict=True):
        assert torch.equal(k[7], k0[3]) and torch.equal(v[7], v0[3])
        assert torch.equal(k[:7], k0[:7]) and torch.equal(v[:7], v0[:7])


def test_out_of_range_pairs_are_refused() -> None:
    e = _engine()
    with pytest.raises(ValueError, match="out of range"):
        e.swap_out([(0, 4)])  # only 4 CPU blocks
    with pytest.raises(ValueError, match="out of range"):
        e.copy([(8, 0)])


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="num_device_blocks"):
        _engine(num_device_blocks=0)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        _engine(num_cpu_blocks=-1)
    assert len(_engine(num_cpu_blocks=0).cpu_caches) == 3  # swap space is optional
