"""The torch reference backend's sliding window and logit soft-capping, against attention written out
token by token (the definition in ops/attention/base.py), over decodes and chunks on cached context."""

from __future__ import annotations

import math

import pytest
import torch

from ops.attention.base import AttentionMetadata
from ops.attention.torch_backend import TorchAttentionBackend


def _naive(q_pos_k: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]], scale: float, window: int | None,
           cap: float | None) -> list[torch.Tensor]:
    """For each (query [Hq, D], position p, keys [p+1, Hkv, D], values): the definition, spelled out."""
    outs = []
    for q, p, k, v in q_pos_k:
        group = q.shape[0] // k.shape[1]
        lo = 0 if window is None else max(0, p - window + 1)
        k = k[lo : p + 1].repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v[lo : p + 1].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q, k) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return outs


@pytest.mark.parametrize("window, cap", [(5, None), (None, 3.0), (7, 2.0), (64, None)])
def test_window_and_soft_cap_match_definition(window: int | None, cap: float | None) -> None:
    torch.manual_seed(0)
    hq, hkv, d, bs = 4, 2, 16, 4
    # rows: two decodes (contexts 9 and 23), a chunk of 6 on 11 cached tokens, a fresh prompt of 13
    cached = [8, 22, 11, 0]
    new = [1, 1, 6, 13]
    total = [c + n for c, n in zip(cached, new, strict=True)]
    seqs_k = [torch.randn(t, hkv, d) for t in total]
    seqs_v = [torch.randn(t, hkv, d) for t in total]
    num_blocks = 1 + sum(math.ceil(t / bs) for t in total)
    kc = torch.zeros(num_blocks, bs, hkv, d)
    vc = torch.zeros_like(kc)
    tables, slots, first = [], [], 1
    for i, t in enumerate(total):
        row = list(range(first, first + math.ceil(t / bs)))
        first += len(row)
        tables.append(row)
        for p in range(t):  # cached tokens are already in the cache; new ones arrive through slot_mapping
            if p < cached[i]:
                kc[row[p // bs], p % bs] = seqs_k[i][p]
                vc[row[p // bs], p % bs] = seqs_v[i][p]
            else:
                slots.append(row[p // bs] * bs + p % bs)
    width = max(len(r) for r in tables)
    q = torch.randn(sum(new), hq, d)
    k_new = torch.cat([seqs_k[i][cached[i] :] for i in range(4)])
    v_new = torch.cat([seqs_v[i][cached[i] :] for i in range(4)])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2, 8, 21], dtype=torch.int32),
        seq_lens=torch.tensor(total, dtype=torch.int32),
        block_tables=torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=13,
        max_seq_len=max(total),
        num_decodes=2,
    )
    backend = TorchAttentionBackend(hq, hkv, d, d**-0.5, sliding_window=window, logits_soft_cap=cap)
    out = backend.forward(q, k_new, v_new, kc, vc, meta)
    cases, t = [], 0
    for i in range(4):
        for j in range(new[i]):
            p = cached[i] + j
            cases.append((q[t], p, seqs_k[i][: p + 1], seqs_v[i][: p + 1]))
            t += 1
    expected = torch.stack(_naive(cases, d**-0.5, window, cap))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_backend_refuses_options_it_does_not_implement() -> None:
    class Plain(TorchAttentionBackend):
        name = "plain"
        supports_sliding_window = False
        supports_logits_soft_cap = False

    with pytest.raises(ValueError, match="does not implement sliding-window"):
        Plain(4, 2, 16, 0.25, sliding_window=8)
    with pytest.raises(ValueError, match="soft-capping"):
        Plain(4, 2, 16, 0.25, logits_soft_cap=30.0)
    with pytest.raises(ValueError, match="positive integer"):
        TorchAttentionBackend(4, 2, 16, 0.25, sliding_window=0)
