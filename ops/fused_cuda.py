"""The gate between the model layers and the Triton layer kernels (ops/triton_layers.py).

`applies(*tensors)` is the one question the layers ask on their CUDA branch: CUDA tensors of a float dtype
with a contiguous last dim, and Triton importable. Triton is imported only when a CUDA tensor first asks,
so CPU-only installs never load it. `kernels()` returns the kernel module.

Tests run the same code path on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set before
triton loads): `interpret_on_cpu()` makes the gate accept CPU tensors in that process.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from types import ModuleType

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_on_cpu = False  # set by interpret_on_cpu() in an interpreter test process only


def interpret_on_cpu() -> None:
    """Route CPU tensors through the Triton kernels (the interpreter runs them); refused without it."""
    global _on_cpu
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpret_on_cpu needs TRITON_INTERPRET=1 set before triton is imported")
    _on_cpu = True


@cache
def _triton_present() -> bool:
    return importlib.util.find_spec("triton") is not None


def applies(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if not (t.is_cuda or _on_cpu) or t.dtype not in _DTYPES or t.stride(-1) != 1:
            return False
    return _triton_present()


@cache
def kernels() -> ModuleType:
    from ops import triton_layers

    return triton_layers
