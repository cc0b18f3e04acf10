"""Attention backends: pick a paged-attention implementation by name.

What each backend can do is its row in `ops/attention/registry.py` (torch-free, the one table: devices,
dtypes, block-size rule, CUDA-graph capture, per-layer options, the package it needs, its place in `auto`'s
order). Backends are imported lazily, only when chosen, so CPU machines never import CUDA packages
(flash-attn, xformers). This module itself imports no torch at load time.

`auto`: the table's candidates for the device, dtype and block size, in order of preference (CUDA:
flash_attn, then triton; CPU: cpu), the first that is usable in this process (its package imports, its
kernels build, a GPU is visible), else the torch reference; never xformers (not paged in place). One log
line names the choice and why the others were passed over. The engine decides the dtype, the block size and
the candidates once (`cluster.engine.resolve_config`) and hands the candidates to every rank, so a rank only
answers what it alone can know: which of them runs here.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ops.attention.registry import ATTENTION_BACKENDS, BACKENDS, auto_candidates, never_auto, static_reason
from ops.dtypes import dtype_name

if TYPE_CHECKING:
    import torch

    from ops.attention.base import AttentionBackend


logger = logging.getLogger(__name__)

FLASH_ATTN_BLOCK_MULTIPLE = BACKENDS["flash_attn"].block_multiple


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
    dname = None if dtype is None else dtype_name(dtype)
    if name == "auto":
        candidates, passed_over = auto_candidates(device.type, dname, block_size)
        return pick_backend(candidates, device, passed_over)
    reason = static_reason(BACKENDS[name], device.type, dname, block_size) or runtime_reason(name, device)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} cannot be used: {reason}.")
    return _load(name)


def pick_backend(
    candidates: Sequence[str], device: torch.device, passed_over: Sequence[str] = ()
) -> type[AttentionBackend]:
    """The first of `candidates` (auto's, in order of preference; the last is the fallback, which runs
    everywhere) usable in this process, logged with why the ones before it were passed over."""
    why = list(passed_over)
    chosen = candidates[-1]
    for candidate in candidates[:-1]:
        reason = runtime_reason(candidate, device)
        if reason is None:
            chosen = candidate
            why.insert(0, "it is usable here")
            break
        why.append(f"not {candidate}: {reason}")
    why += never_auto(device.type)
    # torch on CUDA means a broken install (triton ships with CUDA torch): it gathers, so say it loudly.
    level = logging.WARNING if device.type == "cuda" and chosen == "torch" else logging.INFO
    logger.log(level, "attention_backend=auto on %s chose %r: %s", device, chosen, "; ".join(why))
    return _load(chosen)


def runtime_reason(name: str, device: torch.device) -> str | None:
    """Why backend `name`, which its row allows here, cannot run in this process, or None: what only this
    process can know (a GPU visible, the package imports, the backend's own check such as a kernel build)."""
    import torch

    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is available to this process"
    error = package_error(name)
    return error if error is not None else _load(name).unavailable_reason()


def package_error(name: str) -> str | None:
    """Why the package backend `name` needs does not import here, or None (device-independent)."""
    row = BACKENDS[name]
    if row.package is None:
        return None
    try:
        importlib.import_module(row.package)
    except Exception as exc:  # ImportError, or a CUDA extension built for another torch
        return f"the {row.package.split('.')[0]} package is not importable ({exc}); install {row.requirement}"
    return None


def _load(name: str) -> type[AttentionBackend]:
    row = BACKENDS[name]
    module = importlib.import_module(f"{__name__}.{row.module}")
    cls: type[AttentionBackend] = getattr(module, row.class_name)
    return cls


__all__ = [
    "ATTENTION_BACKENDS",
    "FLASH_ATTN_BLOCK_MULTIPLE",
    "get_attn_backend",
    "package_error",
    "pick_backend",
]
