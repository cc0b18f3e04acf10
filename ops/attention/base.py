"""The one paged-attention interface every backend implements.

A backend receives the whole step's batch at once: packed queries of all scheduled
tokens (decodes and prefill chunks mixed, in the order of `query_start_loc`), and
attends each query token causally over its sequence's cached context plus the new
tokens. New keys/values are written into the paged cache through `slot_mapping`
before attention reads it, so a chunk sees its own tokens and all earlier chunks.

KV cache layout, per layer: key_cache and value_cache each of shape
`[num_blocks, block_size, num_kv_heads, head_dim]` (the layout flash-attn's
`block_table` APIs read directly).

Per-layer options, fixed at construction (one backend instance per layer):
- `sliding_window` w: a query at position p attends only keys at positions k with p - w < k <= p
  (its last w tokens, itself included): HF's `kv_idx > q_idx - sliding_window`, flash-attn's
  `window_size=(w - 1, 0)`. None: full causal attention.
- `logits_soft_cap` c (Gemma 2): scores become c * tanh(scale * q.k / c) before the softmax.
A backend that cannot honour one raises ValueError at construction, naming it (never ignores it).
"""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import torch

from ops.attention.registry import BACKENDS
from ops.cache_ops import write_to_paged_cache
from ops.dtypes import dtype_name, torch_dtype


@dataclass
class AttentionMetadata:
    """Per-step attention inputs; built once per step by the model runner, shared by all layers.

    Sequences are the rows of the batch, tokens are packed in row order.
    """

    # [B+1] int32: row i's new tokens are q[query_start_loc[i] : query_start_loc[i+1]]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached tokens + new tokens) per row
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical block ids per row; unused tail entries are 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) for each new token
    max_query_len: int  # max over rows of the new-token count (1 for an all-decode step)
    max_seq_len: int  # max over rows of seq_lens
    num_decodes: int = 0  # rows [0, num_decodes) have exactly one new token; the runner orders decodes first

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class StepKV(NamedTuple):
    """One layer's keys and values in a step: the new tokens' and the paged cache they are written into.

    By the time a backend's `_attend` runs, `key`/`value` already stand in the cache at the step's
    `slot_mapping`; a backend may read the new ones from either place."""

    key: torch.Tensor  # [T, num_kv_heads, head_dim]: this step's new keys
    value: torch.Tensor  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # same shape as key_cache


class AttentionBackend(ABC):
    """Paged attention over a batch. Stateless apart from what `__init__` precomputes.

    `forward` is the same three steps for every backend (refuse what the kernels cannot take, write the new
    K/V into the cache, attend); a backend implements `_attend` and overrides the other two hooks only where
    its kernels differ."""

    name: str = ""
    # What this backend implements; the constructor refuses the options it does not. A registered backend's
    # flags are its row's (ops/attention/registry.py), set when its class is defined.
    supports_sliding_window: bool = False
    supports_logits_soft_cap: bool = False
    # True declares that a pure-decode `forward` (max_query_len == 1) can be recorded into a CUDA graph and
    # replayed with new values in the same metadata tensors: no host sync (.tolist(), .item(), printing a
    # tensor), no host branch or tensor shape that depends on a metadata tensor's values, and `max_seq_len`
    # read only as an upper bound (captures pass max_model_len; model_exec/cuda_graphs.py). Rows past the
    # real batch are padding whose slots and block tables point at a pad block the scheduler never hands out.
    cuda_graph_capturable: bool = False
    _requirement: str = ""  # its row's pip requirement, named when its package does not import (`_import`)
    _row_dtypes: tuple[torch.dtype, ...] = ()  # its row's dtypes, for backends that check them (`_check_dtypes`)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        row = BACKENDS.get(cls.__dict__.get("name", ""))
        if row is not None:
            cls.supports_sliding_window = row.sliding_window
            cls.supports_logits_soft_cap = row.logits_soft_cap
            cls.cuda_graph_capturable = row.capturable
            cls._row_dtypes = tuple(torch_dtype(n) for n in row.dtypes)
            cls._requirement = row.requirement

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run in this process beyond its row's rules and its package (e.g. its
        kernels do not build), or None."""
        return None

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        if sliding_window is not None:
            if not isinstance(sliding_window, int) or sliding_window < 1:
                raise ValueError(f"sliding_window must be a positive integer or None; got {sliding_window!r}.")
            if not self.supports_sliding_window:
                raise ValueError(f"attention_backend={self.name!r} does not implement sliding-window attention.")
        if logits_soft_cap is not None:
            if not logits_soft_cap > 0:
                raise ValueError(f"logits_soft_cap must be positive or None; got {logits_soft_cap!r}.")
            if not self.supports_logits_soft_cap:
                raise ValueError(f"attention_backend={self.name!r} does not implement attention logit soft-capping.")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self._prepare()

    def _prepare(self) -> None:  # noqa: B027 - optional hook
        """The backend's own set-up, once the base fields are set (and checked): e.g. import its kernels,
        refuse a head_dim they cannot take (ValueError)."""

    def _import(self, module: str) -> ModuleType:
        """Import a module the backend's kernels need, at construction (never at module import, so CPU machines
        import every backend file); ValueError naming the row's pip requirement when it does not import."""
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            package = re.split(r"[<>=!~\[ ]", self._requirement, maxsplit=1)[0]
            raise ValueError(
                f"attention_backend={self.name!r} needs the {package} package (pip install {self._requirement}): {exc}"
            ) from exc

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # same shape as key_cache
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write key/value into the cache at meta.slot_mapping, then attend causally."""
        kv = StepKV(key, value, key_cache, value_cache)
        self._check(query, kv)  # before anything is written: a refused step leaves the cache as it was
        self._write_kv(kv, meta.slot_mapping)
        return self._attend(query, kv, meta)

    def _check(self, query: torch.Tensor, kv: StepKV) -> None:  # noqa: B027 - optional hook
        """Raise ValueError for inputs the kernels cannot take (a dtype, a block size)."""

    def _check_dtypes(self, query: torch.Tensor, kv: StepKV) -> None:
        """Refuse a query or cache dtype outside this backend's row (ops/attention/registry.py)."""
        if query.dtype not in self._row_dtypes or kv.key_cache.dtype not in self._row_dtypes:
            names = "/".join(dtype_name(d) for d in self._row_dtypes)
            raise ValueError(
                f"attention_backend={self.name!r} supports {names}; got query {query.dtype}, "
                f"cache {kv.key_cache.dtype}."
            )

    def _write_kv(self, kv: StepKV, slot_mapping: torch.Tensor) -> None:
        """The step's new keys/values into their cache slots (in place)."""
        write_to_paged_cache(kv.key, kv.value, kv.key_cache, kv.value_cache, slot_mapping)

    @abstractmethod
    def _attend(self, query: torch.Tensor, kv: StepKV, meta: AttentionMetadata) -> torch.Tensor:
        """Attend every query token causally over its row's keys, the new ones already in the cache."""
