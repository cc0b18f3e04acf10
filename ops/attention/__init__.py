"""Attention backend registry: pick a paged-attention implementation by name.

Backends are imported lazily, only when chosen, so CPU machines never import CUDA packages
(flash-attn, xformers). This module itself imports no torch at load time.

| name         | where                                 | constraint                                   |
| ------------ | ------------------------------------- | -------------------------------------------- |
| `torch`      | everywhere; the reference             | none                                         |
| `cpu`        | CPU, a C++ decode kernel built at first use (`cpu_kernels`) | float32; g++ and ninja to build |
| `flash_attn` | CUDA + `flash-attn>=2.6`              | fp16/bf16; KV block_size a multiple of 256   |
| `xformers`   | CUDA + `xformers>=0.0.28`             | none beyond xformers' own kernel limits      |
| `auto`       | CUDA: flash_attn if usable, else xformers if usable, else torch; CPU: cpu if it builds, else torch |
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ops.attention.names import ATTENTION_BACKENDS  # torch-free, so configs can validate names
from ops.attention.names import BACKENDS as _REGISTRY

if TYPE_CHECKING:
    import torch

    from ops.attention.base import AttentionBackend


_PACKAGE = {"flash_attn": "flash_attn", "xformers": "xformers.ops"}

# Upstream flash-attn's paged-KV kernels accept only page (block) sizes that are multiples of this.
FLASH_ATTN_BLOCK_MULTIPLE = 256


def get_attn_backend(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
) -> type[AttentionBackend]:
    """The backend class for `name` on `device`.

    `dtype` (the KV/activation dtype) and `block_size` (the KV block size) let `auto` skip a
    backend that would fail at the first step; pass them when known. `auto` never picks
    flash_attn unless `block_size` is given and supported, nor cpu unless `dtype` is float32.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}.")
    import torch

    device = torch.device(device)
    if name == "auto":
        for candidate in ("flash_attn", "xformers") if device.type == "cuda" else ("cpu",):
            if _unavailable_reason(candidate, device, dtype, block_size, strict=False) is None:
                return _load(candidate)
        return _load("torch")
    reason = _unavailable_reason(name, device, dtype, block_size, strict=True)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} cannot be used: {reason}.")
    return _load(name)


def _unavailable_reason(
    name: str, device: torch.device, dtype: torch.dtype | None, block_size: int | None, strict: bool
) -> str | None:
    """Why backend `name` cannot run here, or None. `strict=False` also rejects unknown block sizes."""
    import torch

    if name == "torch":
        return None
    if name == "cpu":
        if device.type != "cpu":
            return f"it runs only on the CPU and the device is {str(device)!r} (use 'torch' or 'auto')"
        if dtype is None and not strict:
            return "the dtype is unknown"
        if dtype is not None and dtype != torch.float32:
            return f"its kernel supports float32 only; the dtype is {dtype}"
        from ops.attention import cpu_kernels

        return cpu_kernels.load_error()
    if device.type != "cuda":
        return f"it runs only on CUDA devices and the device is {str(device)!r} (use 'torch' or 'auto')"
    if not torch.cuda.is_available():
        return "no CUDA device is available to this process"
    try:
        importlib.import_module(_PACKAGE[name])
    except Exception as exc:  # ImportError, or a CUDA extension built for another torch
        package = _PACKAGE[name].split(".")[0]
        return f"the {package} package is not importable ({exc}); install {_REGISTRY[name][2]}"
    if name == "flash_attn":
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn supports float16 and bfloat16 only; the dtype is {dtype}"
        if block_size is None and not strict:
            return "the KV block size is unknown"
        if block_size is not None and block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
            return (
                f"flash-attn reads a paged KV cache only when block_size is a multiple of "
                f"{FLASH_ATTN_BLOCK_MULTIPLE}; block_size is {block_size}"
            )
    return None


def _load(name: str) -> type[AttentionBackend]:
    module_name, class_name, _ = _REGISTRY[name]
    module = importlib.import_module(f"{__name__}.{module_name}")
    cls: type[AttentionBackend] = getattr(module, class_name)
    return cls


__all__ = ["ATTENTION_BACKENDS", "FLASH_ATTN_BLOCK_MULTIPLE", "get_attn_backend"]
