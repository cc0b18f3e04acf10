"""KV sizing (model_exec/kv_sizing.py) driven through a fake of torch.cuda's memory API.

The fake keeps a device of `total` bytes, memory outside torch (other processes, the CUDA context,
cuBLAS/NCCL buffers) and a caching allocator (allocated <= reserved, a peak of reserved), and answers
mem_get_info / memory_stats as torch.cuda does.
"""

from __future__ import annotations

from typing import Any

import pytest

from model_exec.kv_sizing import KVBudget, kv_budget, measure_kv_budget, take_snapshot

GiB = 1 << 30
DEVICE = "cuda:0"


class FakeCudaMemory:
    def __init__(self, total: int, outside: int) -> None:
        self.total = total
        self.outside = outside  # bytes in use outside this process's caching allocator
        self.allocated = 0
        self.reserved = 0
        self.reserved_peak = 0
        self.calls: list[str] = []

    # what a run does
    def alloc(self, nbytes: int, slack: int = 0) -> None:
        """Live tensors of nbytes; the allocator reserves `slack` more (rounding, fragmentation)."""
        self.allocated += nbytes
        self.reserved += nbytes + slack
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes  # the allocator keeps the segments until empty_cache

    # torch.cuda's API
    def mem_get_info(self, device: Any) -> tuple[int, int]:
        assert device == DEVICE
        return self.total - self.outside - self.reserved, self.total

    def memory_stats(self, device: Any) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self.allocated,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.reserved_peak,
        }

    def reset_peak_memory_stats(self, device: Any) -> None:
        self.calls.append("reset_peak")
        self.reserved_peak = self.reserved

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = self.allocated

    def synchronize(self, device: Any) -> None:
        self.calls.append("synchronize")


BLOCK = 2 * 32 * 16 * 8 * 128 * 2  # Llama-3-8B-shaped, block_size 16, bf16: 2 MiB


def load_and_profile(mem: FakeCudaMemory, util: float = 0.9) -> KVBudget:
    """An 80 GiB device: 2 GiB held by another process and the context; 16 GiB of weights (a 0.25 GiB
    loading temporary freed); a profile step of 3 GiB activations with 0.2 GiB of allocator slack, during
    which cuBLAS takes a 0.25 GiB workspace outside torch."""
    before = take_snapshot(mem, DEVICE)
    mem.alloc(16 * GiB)
    mem.alloc(GiB // 4)
    mem.free(GiB // 4)
    after_load = take_snapshot(mem, DEVICE)

    def profile() -> None:
        mem.calls.append("profile")
        mem.alloc(3 * GiB, slack=GiB // 5)
        mem.outside += GiB // 4
        mem.free(3 * GiB)

    return measure_kv_budget(
        mem, DEVICE, before, after_load, profile, gpu_memory_utilization=util, bytes_per_block=BLOCK
    )


def test_budget_counts_weights_activations_with_slack_and_memory_outside_torch() -> None:
    mem = FakeCudaMemory(total=80 * GiB, outside=2 * GiB)
    budget = load_and_profile(mem)
    requested = int(80 * GiB * 0.9)
    assert budget.requested == requested
    assert budget.weights == 16 * GiB
    assert budget.activation_peak == 3 * GiB + GiB // 5  # the slack is memory the step held
    assert budget.non_torch == GiB // 4  # the other process's 2 GiB was there before: not ours
    assert budget.kv_cache == requested - 16 * GiB - (3 * GiB + GiB // 5) - GiB // 4
    assert budget.num_blocks == budget.kv_cache // BLOCK
    # The pool fits: what the rank holds with the pool allocated stays within what was free at start.
    held = budget.weights + budget.activation_peak + budget.non_torch + budget.num_blocks * BLOCK
    assert held <= requested <= 80 * GiB - 2 * GiB
    # The profile step ran from clean peak counters, and the cache was emptied for the pool.
    assert mem.calls == ["empty_cache", "reset_peak", "profile", "synchronize", "empty_cache"]
    assert mem.reserved == mem.allocated == 16 * GiB


def test_one_log_line_gives_every_figure_in_gib() -> None:
    budget = load_and_profile(FakeCudaMemory(total=80 * GiB, outside=2 * GiB))
    line = budget.describe()
    assert "\n" not in line
    for part in ("weights 16.00 GiB", "activation peak 3.20 GiB", "non-torch 0.25 GiB", "KV cache 52.55 GiB"):
        assert part in line, line
    assert line.endswith(f"= {budget.num_blocks} blocks") and budget.num_blocks == 26905


def test_lower_utilisation_gives_fewer_blocks() -> None:
    high = load_and_profile(FakeCudaMemory(total=80 * GiB, outside=2 * GiB), util=0.9)
    low = load_and_profile(FakeCudaMemory(total=80 * GiB, outside=2 * GiB), util=0.5)
    assert (high.kv_cache - low.kv_cache) == int(80 * GiB * 0.9) - int(80 * GiB * 0.5)
    assert low.num_blocks < high.num_blocks


def test_start_is_refused_when_other_processes_hold_what_utilisation_asks_for() -> None:
    with pytest.raises(ValueError, match=r"only 70\.00 GiB .* were free at start.*gpu_memory_utilization=0\.9"):
        load_and_profile(FakeCudaMemory(total=80 * GiB, outside=10 * GiB))


def test_no_room_for_a_block_names_the_parts() -> None:
    mem = FakeCudaMemory(total=20 * GiB, outside=GiB // 2)
    with pytest.raises(ValueError, match=r"no room for the KV cache.*weights take 16\.00 GiB.*activations 3\.20"):
        load_and_profile(mem)


def test_bad_arguments_are_refused() -> None:
    mem = FakeCudaMemory(total=80 * GiB, outside=0)
    snap = take_snapshot(mem, DEVICE)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget(snap, snap, snap, gpu_memory_utilization=0.0, bytes_per_block=BLOCK)
    with pytest.raises(ValueError, match="bytes_per_block"):
        kv_budget(snap, snap, snap, gpu_memory_utilization=0.9, bytes_per_block=0)
