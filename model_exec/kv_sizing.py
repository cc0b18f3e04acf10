"""How many KV blocks a CUDA rank can hold, measured the way vLLM measures it.

Three snapshots of the device's memory: before the rank loads anything (after its CUDA context
exists), after its weights are loaded, and after one profile step (the largest forward pass plus a
sampler pass over `max_num_seqs` rows). From them:

    requested     = total * gpu_memory_utilization
    weights       = torch allocated after loading - before loading
    activation    = torch reserved at the profile step's peak - before loading - weights
                    (reserved, not allocated: the allocator's slack at the peak is memory held too)
    non-torch     = growth of (used - torch reserved) from before loading to after profiling: cuBLAS
                    workspaces, NCCL buffers, CUDA graphs' private pools outside torch's caching
                    allocator, and whatever other processes took meanwhile
    KV cache      = requested - weights - activation - non-torch

Invariant: this rank holds at most `requested` bytes beyond what was in use when it started, so the
start is refused when fewer than `requested` bytes were free then (another process holds the GPU).
The CUDA context and other processes' earlier memory sit in what `gpu_memory_utilization` leaves out.

Torch-free: `DeviceMemory` is the slice of `torch.cuda` read here, so tests drive the arithmetic and
the measuring sequence with a fake.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

_GiB = float(1 << 30)


class DeviceMemory(Protocol):
    """What `measure_kv_budget` calls; `torch.cuda` is one."""

    def mem_get_info(self, device: Any) -> tuple[int, int]: ...  # (free, total) bytes, all processes counted

    def memory_stats(self, device: Any) -> dict[str, Any]: ...  # the caching allocator's counters

    def reset_peak_memory_stats(self, device: Any) -> None: ...

    def empty_cache(self) -> None: ...

    def synchronize(self, device: Any) -> None: ...


@dataclass(frozen=True)
class MemorySnapshot:
    free: int  # device memory free, whoever uses the rest (cudaMemGetInfo)
    total: int
    torch_allocated: int  # bytes in live tensors of this process
    torch_reserved: int  # bytes the caching allocator holds from the driver (allocated + its slack)
    torch_reserved_peak: int  # highest torch_reserved since the last peak reset

    @property
    def used(self) -> int:
        return self.total - self.free

    @property
    def non_torch(self) -> int:
        """Device memory in use outside this process's caching allocator."""
        return self.used - self.torch_reserved


def take_snapshot(mem: DeviceMemory, device: Any) -> MemorySnapshot:
    free, total = mem.mem_get_info(device)
    stats = mem.memory_stats(device)
    return MemorySnapshot(
        free=int(free),
        total=int(total),
        torch_allocated=int(stats.get("allocated_bytes.all.current", 0)),
        torch_reserved=int(stats.get("reserved_bytes.all.current", 0)),
        torch_reserved_peak=int(stats.get("reserved_bytes.all.peak", 0)),
    )


@dataclass(frozen=True)
class KVBudget:
    total: int
    requested: int
    weights: int
    activation_peak: int
    non_torch: int
    kv_cache: int
    num_blocks: int

    def describe(self) -> str:
        """The one log line of the sizing."""
        return (
            f"KV sizing: {self.requested / _GiB:.2f} GiB requested of {self.total / _GiB:.2f} GiB; "
            f"weights {self.weights / _GiB:.2f} GiB, activation peak {self.activation_peak / _GiB:.2f} GiB, "
            f"non-torch {self.non_torch / _GiB:.2f} GiB, KV cache {self.kv_cache / _GiB:.2f} GiB "
            f"= {self.num_blocks} blocks"
        )


def kv_budget(
    before_load: MemorySnapshot,
    after_load: MemorySnapshot,
    after_profile: MemorySnapshot,
    *,
    gpu_memory_utilization: float,
    bytes_per_block: int,
) -> KVBudget:
    """The arithmetic of the module docstring. Raises ValueError when not even one block fits."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}.")
    total = before_load.total
    requested = int(total * gpu_memory_utilization)
    if before_load.free < requested:
        raise ValueError(
            f"only {before_load.free / _GiB:.2f} GiB of the device's {total / _GiB:.2f} GiB were free at start, "
            f"less than gpu_memory_utilization={gpu_memory_utilization} asks for ({requested / _GiB:.2f} GiB): "
            "lower gpu_memory_utilization or free the memory other processes hold."
        )
    weights = max(after_load.torch_allocated - before_load.torch_allocated, 0)
    torch_peak = max(after_profile.torch_reserved_peak, after_profile.torch_reserved) - before_load.torch_reserved
    activation = max(torch_peak - weights, 0)
    non_torch = max(after_profile.non_torch - before_load.non_torch, 0)
    kv_cache = requested - weights - activation - non_torch
    if kv_cache < bytes_per_block:
        raise ValueError(
            f"no room for the KV cache: of the {requested / _GiB:.2f} GiB gpu_memory_utilization="
            f"{gpu_memory_utilization} allows, weights take {weights / _GiB:.2f} GiB, the profile step's "
            f"activations {activation / _GiB:.2f} GiB and memory outside torch {non_torch / _GiB:.2f} GiB; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs."
        )
    return KVBudget(total, requested, weights, activation, non_torch, kv_cache, kv_cache // bytes_per_block)


def measure_kv_budget(
    mem: DeviceMemory,
    device: Any,
    before_load: MemorySnapshot,
    after_load: MemorySnapshot,
    run_profile: Callable[[], None],
    *,
    gpu_memory_utilization: float,
    bytes_per_block: int,
) -> KVBudget:
    """Run the profile step from clean peak counters, snapshot, and size the pool. The allocator's cache is
    emptied before (so the peak is the step's own) and after (so the KV pool can take that memory)."""
    mem.empty_cache()
    mem.reset_peak_memory_stats(device)
    run_profile()
    mem.synchronize(device)
    after_profile = take_snapshot(mem, device)
    mem.empty_cache()
    return kv_budget(
        before_load,
        after_load,
        after_profile,
        gpu_memory_utilization=gpu_memory_utilization,
        bytes_per_block=bytes_per_block,
    )
