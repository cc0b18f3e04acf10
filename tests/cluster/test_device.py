"""The device-dependent defaults: KV block size 128 on CPU, 16 on CUDA, a given block_size kept."""

from __future__ import annotations

import pytest
import torch

from cluster.config import EngineConfig
from cluster.device import CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE, default_block_size, runs_on_cuda


@pytest.mark.parametrize(("device", "cuda"), [("cpu", False), ("cuda", True)])
def test_an_explicit_device_decides(device: str, cuda: bool) -> None:
    config = EngineConfig(device=device)
    assert runs_on_cuda(config) is cuda
    assert default_block_size(config) == (CUDA_BLOCK_SIZE if cuda else CPU_BLOCK_SIZE)


@pytest.mark.parametrize("available", [False, True])
def test_auto_in_process_asks_torch(monkeypatch: pytest.MonkeyPatch, available: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    config = EngineConfig(device="auto", distributed_executor_backend="inprocess")
    assert default_block_size(config) == (CUDA_BLOCK_SIZE if available else CPU_BLOCK_SIZE)


def test_block_size_is_validated_only_when_given() -> None:
    assert EngineConfig().block_size is None
    assert EngineConfig(block_size=32).block_size == 32
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(block_size=24)
