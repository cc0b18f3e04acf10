"""The device-dependent defaults: `auto` resolved once, KV block size 128 on CPU and 16 on CUDA
(256 where flash-attn serves `auto`: tests/ops/test_triton_attention.py)."""

from __future__ import annotations

import pytest
import torch

from cluster.config import EngineConfig, default_kv_cache_bytes
from cluster.device import CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE, default_block_size, resolve_device
from cluster.engine import resolve_config
from model_exec.config import ModelConfig
from tests.helpers.tiny_models import tiny_llama_config


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_explicit_device_decides(device: str) -> None:
    assert resolve_device(EngineConfig(device=device)) == device


@pytest.mark.parametrize("available", [False, True])
def test_auto_in_process_asks_torch(monkeypatch: pytest.MonkeyPatch, available: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    config = EngineConfig(device="auto", distributed_executor_backend="inprocess")
    assert resolve_device(config) == ("cuda" if available else "cpu")


def test_default_block_size_per_device() -> None:
    sizes = (default_block_size("cpu"), default_block_size("cuda", "triton"))
    assert sizes == (CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE) == (128, 16)


@pytest.mark.parametrize(("given", "expected"), [(None, CPU_BLOCK_SIZE), (32, 32)])
def test_resolve_config_fills_device_and_block_size(given: int | None, expected: int) -> None:
    model = ModelConfig.from_hf_config(tiny_llama_config())
    config = resolve_config(EngineConfig(device="cpu", block_size=given), model)
    assert (config.device, config.block_size) == ("cpu", expected)


def test_block_size_is_validated_only_when_given() -> None:
    assert EngineConfig().block_size is None
    assert EngineConfig(block_size=32).block_size == 32
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(block_size=24)


def test_the_cpu_kv_budget_default_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """RAYTP_CPU_KVCACHE_SPACE (GiB, as vLLM's VLLM_CPU_KVCACHE_SPACE) sets the default; unset, a quarter of RAM
    up to 4 GiB; a malformed value is refused by name."""
    monkeypatch.setenv("RAYTP_CPU_KVCACHE_SPACE", "0.5")
    assert default_kv_cache_bytes() == 1 << 29
    monkeypatch.delenv("RAYTP_CPU_KVCACHE_SPACE")
    assert 0 < default_kv_cache_bytes() <= 4 << 30
    for bad in ("lots", "0"):
        monkeypatch.setenv("RAYTP_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match="RAYTP_CPU_KVCACHE_SPACE"):
            default_kv_cache_bytes()
