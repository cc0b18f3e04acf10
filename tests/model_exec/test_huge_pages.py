"""model_exec.huge_pages: the KV pool and packed weights on transparent huge pages, values untouched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from model_exec import huge_pages

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_allowed() -> bool:
    return sys.platform.startswith("linux") and _THP.exists() and "[never]" not in _THP.read_text()


def test_zeros_is_torch_zeros() -> None:
    for shape, dtype in (((3, 5), torch.float32), ((700, 1024, 3), torch.float32), ((2, 2 << 20), torch.bfloat16)):
        t = huge_pages.zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()


def test_advise_covers_the_aligned_interior_and_keeps_values() -> None:
    if not _thp_allowed():
        pytest.skip("needs Linux with transparent huge pages not set to 'never'")
    t = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: at least four whole 2 MiB pages inside
    expected = t.clone()
    advised = huge_pages.advise(t, collapse=True)
    assert advised >= 4 * huge_pages.HUGE_PAGE and advised % huge_pages.HUGE_PAGE == 0
    assert advised <= t.numel() * t.element_size()
    assert torch.equal(t, expected)


def test_advise_skips_what_it_cannot_cover() -> None:
    assert huge_pages.advise(torch.zeros(1000)) == 0  # smaller than one huge page
    assert huge_pages.advise(torch.zeros(1 << 22)[::2]) == 0  # not contiguous


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_zeros_is_populated_at_once_and_keeps_its_mapping() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/statm")
    before = _rss_bytes()
    pool = huge_pages.zeros((256, 1 << 20), torch.float32)  # 1 GiB
    grew = _rss_bytes() - before
    if huge_pages.populate(pool):  # the kernel has MADV_POPULATE_WRITE: no step faults the pool in later
        assert grew >= (1 << 30) - (4 << 20)
    view = pool[100]
    del pool  # the view alone keeps the mapping
    view[:4] = 2.0
    assert view[:5].tolist() == [2.0, 2.0, 2.0, 2.0, 0.0] and not view[5:].any()
