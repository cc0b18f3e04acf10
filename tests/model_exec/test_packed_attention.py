"""model_exec/layers/packed_attention.py: per-sequence bidirectional attention over packed rows, against
torch's SDPA run on each sequence alone; and the encoder's choice of dense MKL linears (models.pack_weights)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from model_exec.layers import cpu_gemm
from model_exec.layers.packed_attention import packed_bidirectional_attention, sequence_bounds


def test_each_sequence_attends_to_itself_only() -> None:
    torch.manual_seed(0)
    heads, head_dim, lengths = 3, 8, [5, 1, 9, 4]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim)
    bounds = sequence_bounds(starts)
    assert bounds == [(0, 5), (5, 6), (6, 15), (15, 19)]
    out = packed_bidirectional_attention(qkv.clone(), bounds, heads, head_dim)
    assert out.shape == (sum(lengths), heads * head_dim)
    for start, end in bounds:
        q, k, v = qkv[start:end].view(end - start, 3, heads, head_dim).permute(1, 2, 0, 3)
        ref = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(end - start, -1)
        torch.testing.assert_close(out[start:end], ref, atol=1e-6, rtol=1e-5)


def test_changing_one_sequence_leaves_the_others_alone() -> None:
    torch.manual_seed(1)
    heads, head_dim = 2, 4
    bounds = [(0, 3), (3, 7)]
    qkv = torch.randn(7, 3 * heads * head_dim)
    before = packed_bidirectional_attention(qkv.clone(), bounds, heads, head_dim)
    qkv[3:] = torch.randn(4, 3 * heads * head_dim)
    after = packed_bidirectional_attention(qkv.clone(), bounds, heads, head_dim)
    assert torch.equal(before[:3], after[:3])
    assert not torch.allclose(before[3:], after[3:])


def test_the_encoder_keeps_dense_linears_only_where_mkl_has_its_fast_paths() -> None:
    from transformers import BertConfig

    from model_exec.config import ModelConfig
    from model_exec.layers.linear import QKVParallelLinear
    from model_exec.models import pack_weights
    from model_exec.models.bert import BertModel
    from model_exec.parallel import TPGroup
    from ops.attention.torch_backend import TorchAttentionBackend

    hf = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                    max_position_embeddings=16, architectures=["BertModel"])  # fmt: skip
    # as model_exec/source.py reads a folder's config.json
    config = ModelConfig.from_hf_config(SimpleNamespace(**hf.to_dict()))
    model = BertModel(config, TPGroup.single(), TorchAttentionBackend)
    for p in model.parameters():
        p.data.normal_()
    pack_weights(model)
    qkv = next(m for m in model.modules() if isinstance(m, QKVParallelLinear))
    packed = qkv.panel_weight is not None or qkv.packed_weight is not None
    if cpu_gemm.mkl_fast_paths():  # dense for MKL on an Intel CPU
        assert not packed and qkv.weight.stride() == (16, 1)
    else:  # the panels or oneDNN, as for every other model
        assert packed == cpu_gemm.can_pack(torch.empty(48, 16))
    x = torch.randn(5, 16)
    assert qkv(x).shape == (5, 48)
