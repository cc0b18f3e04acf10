"""Dtype names, torch-free: the one list configs validate against and the one map to torch dtypes.

Configs and the backend table (ops/attention/registry.py) speak canonical names ("float32", "float16",
"bfloat16"); `canonical_dtype` folds the aliases users may write (vLLM's "float", "half"), and only a process
that runs the model turns a name into a torch dtype (`torch_dtype`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_ALIASES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16"}
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")  # canonical
DTYPE_NAMES: tuple[str, ...] = tuple(_ALIASES)  # every name a config accepts besides "auto"
HALF_DTYPES: tuple[str, ...] = ("float16", "bfloat16")


def canonical_dtype(name: str) -> str:
    """The canonical name of a dtype name or alias; ValueError naming the accepted ones otherwise."""
    try:
        return _ALIASES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {name!r}.") from None


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype: torch.dtype = getattr(torch, canonical_dtype(name))
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a torch dtype ("float64" etc. for ones no config accepts)."""
    return str(dtype).removeprefix("torch.")
