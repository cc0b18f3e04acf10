"""The pooling head: one step's packed hidden states -> one vector (or score) per request.

Every row of a pooling step is a whole prompt (the engine runs pooling without chunked prefill), so
row i's tokens are hidden[starts[i]:starts[i+1]]. Runs on rank 0 only, over the hidden states every
rank holds whole after the final norm (and the classification head, replicated). Pooling, then
Matryoshka truncation, then normalization, in float32: vLLM's order, and sentence-transformers'
when it truncates (`truncate_dim`) before its Normalize module.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from model_exec.pooling_config import PoolerConfig
from request.pooling_params import PoolingParams


class ScoreHead(Protocol):
    """A cross-encoder's head over its first tokens' hidden states [B, H] -> logits [B, num_labels]."""

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor: ...


class Pooler:
    def __init__(self, config: PoolerConfig, score_head: ScoreHead | None = None) -> None:
        if config.task == "score" and score_head is None:
            raise ValueError("a score model needs its classification head")
        self.config = config
        self.score_head = score_head

    def pool(self, hidden: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """[T, H] packed hidden states -> [B, H] float32, one row per prompt."""
        kind = self.config.pooling_type
        dev = hidden.device
        if kind == "CLS":
            return hidden[torch.tensor(starts[:-1], device=dev)].float()
        if kind == "LAST":
            return hidden[torch.tensor(starts[1:], device=dev) - 1].float()
        lengths = torch.tensor([b - a for a, b in zip(starts, starts[1:], strict=False)], device=dev)
        row_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths)
        sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32, device=dev)
        sums.index_add_(0, row_of_token, hidden.float())
        return sums / lengths[:, None].float()

    def __call__(self, hidden: torch.Tensor, starts: list[int], params: list[PoolingParams]) -> list[np.ndarray]:
        pooled = self.pool(hidden, starts)
        if self.config.task == "score":
            assert self.score_head is not None
            logits = self.score_head.classify(pooled.to(hidden.dtype)).float()
            if self.config.activation == "sigmoid":
                logits = torch.sigmoid(logits)
            return list(logits.cpu().numpy())
        out: list[np.ndarray] = []
        for row, p in zip(pooled, params, strict=True):
            if p.dimensions is not None:
                row = row[: p.dimensions]
            if self.config.normalize if p.normalize is None else p.normalize:
                row = F.normalize(row, p=2, dim=0)
            out.append(row.cpu().numpy())
        return out
