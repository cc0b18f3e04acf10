"""Attention backend registry: pick a paged-attention implementation by name.

Backends are imported lazily, only when chosen, so CPU machines never import CUDA packages
(flash-attn, xformers). This module itself imports no torch at load time.

| name         | where                                   | constraint                                 |
| ------------ | --------------------------------------- | ------------------------------------------ |
| `torch`      | everywhere; the reference (gathers)     | none                                       |
| `cpu`        | CPU, C++ kernels built at first use     | float32; g++ and ninja to build            |
| `triton`     | CUDA + triton (ships with CUDA torch)   | fp16/bf16/fp32; any block size; D <= 256   |
| `flash_attn` | CUDA + `flash-attn>=2.6`                | fp16/bf16; block_size a multiple of 256    |
| `xformers`   | CUDA + `xformers>=0.0.28`               | gathers every row's context per layer      |
| `auto`       | CUDA: flash_attn if usable, else triton, else torch; never xformers (not paged in place).
|              | CPU: cpu if it builds and the dtype is float32, else torch. Logs its choice and why.  |

On CUDA, triton and flash_attn read K/V through the block table in place; torch and xformers copy them out.
`auto` and the KV block size are decided together: when `block_size` is not given, CUDA gets
`FLASH_ATTN_BLOCK_MULTIPLE` where flash-attn imports and the dtype is half precision, else 16
(`cluster.device.default_block_size`), so `auto` then finds flash_attn usable; triton reads any size.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from ops.attention.names import ATTENTION_BACKENDS  # torch-free, so configs can validate names
from ops.attention.names import BACKENDS as _REGISTRY

if TYPE_CHECKING:
    import torch

    from ops.attention.base import AttentionBackend


logger = logging.getLogger(__name__)

_PACKAGE = {"flash_attn": "flash_attn", "xformers": "xformers.ops", "triton": "triton"}

# Why `auto` never picks xformers, though it runs wherever it imports.
XFORMERS_NOT_AUTO = (
    "xformers is never picked by auto: it gathers every row's whole context per layer (not paged in place)"
)

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
    flash_attn unless `block_size` is given and supported, nor cpu unless `dtype` is float32;
    it logs one line naming its choice and why the backends before it were passed over.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}.")
    import torch

    device = torch.device(device)
    if name == "auto":
        chosen, why = choose_auto(device, dtype, block_size)
        # torch on CUDA means a broken install (triton ships with CUDA torch): it gathers, so say it loudly.
        level = logging.WARNING if device.type == "cuda" and chosen == "torch" else logging.INFO
        logger.log(level, "attention_backend=auto on %s chose %r: %s", device, chosen, why)
        return _load(chosen)
    reason = _unavailable_reason(name, device, dtype, block_size, strict=True)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} cannot be used: {reason}.")
    return _load(name)


def choose_auto(device: torch.device, dtype: torch.dtype | None, block_size: int | None) -> tuple[str, str]:
    """`auto`'s backend for this device and why: the first usable of the device's candidates, in order
    of preference (each one reads the paged cache in place), else the torch reference."""
    candidates = ("flash_attn", "triton") if device.type == "cuda" else ("cpu",)
    passed_over: list[str] = []
    for candidate in candidates:
        reason = _unavailable_reason(candidate, device, dtype, block_size, strict=False)
        if reason is None:
            why = "; ".join([f"it is usable here (dtype {dtype}, block_size {block_size})", *passed_over])
            break
        passed_over.append(f"not {candidate}: {reason}")
    else:
        candidate, why = "torch", "; ".join(passed_over)
    if device.type == "cuda":
        why += f"; {XFORMERS_NOT_AUTO}"
    return candidate, why


def flash_attn_error() -> str | None:
    """Why the flash-attn package does not import here, or None (device-independent)."""
    return _import_error("flash_attn")


def _import_error(name: str) -> str | None:
    try:
        importlib.import_module(_PACKAGE[name])
    except Exception as exc:  # ImportError, or a CUDA extension built for another torch
        package = _PACKAGE[name].split(".")[0]
        return f"the {package} package is not importable ({exc}); install {_REGISTRY[name][2]}"
    return None


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
    import_error = _import_error(name)
    if import_error is not None:
        return import_error
    if name == "triton" and dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"its kernels support float16, bfloat16 and float32; the dtype is {dtype}"
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


__all__ = ["ATTENTION_BACKENDS", "FLASH_ATTN_BLOCK_MULTIPLE", "choose_auto", "flash_attn_error", "get_attn_backend"]
