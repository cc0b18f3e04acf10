"""The tensor-parallel group a model shard talks through.

Layers never ask `torch.distributed` who they are: they are handed a `TPGroup`
at construction. At world size 1 every collective is the identity and
`torch.distributed` is never initialised, so single-process use needs no setup.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist


class TPGroup:
    """One rank's view of its tensor-parallel group."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid tensor-parallel rank {rank} for world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.group = group  # None: the default (world) group, which is the TP group itself

    @classmethod
    def single(cls) -> TPGroup:
        """The trivial group of one rank; no torch.distributed involved."""
        return cls(0, 1)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns `x`."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's `x` along `dim` on rank 0; None on the other ranks.

        All ranks must pass tensors of the same shape (shards are padded to equal size).
        """
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dst = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (every rank passes a tensor of the same shape); returns `x`."""
        if self.world_size == 1:
            return x
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(x, src=src, group=self.group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def destroy(self) -> None:
        """Tear down the process group this TPGroup created (no-op at world size 1)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, world_size={self.world_size})"


def init_tp_group(
    rank: int,
    world_size: int,
    init_method: str,
    backend: Literal["gloo", "nccl"],
    timeout_s: float,
) -> TPGroup:
    """Join the tensor-parallel group as `rank`; one process per rank.

    `init_method` is a torch.distributed URL (`tcp://host:port` or `file:///path`)
    chosen by the caller, so nothing here hard-codes a port. The TP group is the
    process's default group: each model replica's workers form their own world.
    With NCCL, select the rank's CUDA device (torch.cuda.set_device) before calling.
    """
    if world_size == 1:
        return TPGroup.single()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown torch.distributed backend {backend!r}; expected 'gloo' or 'nccl'")
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return TPGroup(rank, world_size)
