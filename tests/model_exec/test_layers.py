"""Tensor-parallel layers: shard loading and forward at world sizes 1, 2 and 4; norms; rotary vs HF.

World sizes > 1 run one thread per rank with real (thread-simulated) collectives, so the
row-parallel all-reduce, vocab-parallel masking and the LM-head gather are exercised as
the model uses them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from model_exec.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    compute_inv_freq,
)
from model_exec.parallel import TPGroup
from tests.helpers.tiny_models import run_in_rank_threads

REPO = Path(__file__).resolve().parents[2]

WORLD_SIZES = [1, 2, 4]
IN, OUT = 16, 24


def _load(param: torch.nn.Parameter, full: torch.Tensor, shard_id: str | int | None = None) -> None:
    param.weight_loader(param, full, shard_id)  # type: ignore[attr-defined]


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_tp_group_single_is_identity() -> None:
    tp = TPGroup.single()
    x = torch.randn(3, 5)
    assert tp.rank == 0 and tp.world_size == 1
    assert tp.all_reduce(x) is x
    assert tp.gather(x) is x
    with pytest.raises(ValueError):
        TPGroup(2, 2)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_column_parallel(ws: int, gen: torch.Generator) -> None:
    w, b, x = (
        torch.randn(OUT, IN, generator=gen),
        torch.randn(OUT, generator=gen),
        torch.randn(5, IN, generator=gen),
    )

    def rank(tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
        layer = ColumnParallelLinear(IN, OUT, bias=True, tp=tp)
        assert layer.weight.shape == (OUT // ws, IN)
        _load(layer.weight, w)
        _load(layer.bias, b)
        return layer.weight.detach().clone(), layer(x)

    shards, outs = zip(*run_in_rank_threads(ws, rank), strict=True)
    torch.testing.assert_close(torch.cat(shards), w, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b))


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_merged_column_parallel_gate_up(ws: int, gen: torch.Generator) -> None:
    inter = 32
    gate, up = torch.randn(inter, IN, generator=gen), torch.randn(inter, IN, generator=gen)
    x = torch.randn(5, IN, generator=gen)

    def rank(tp: TPGroup) -> torch.Tensor:
        layer = MergedColumnParallelLinear(IN, [inter, inter], bias=False, tp=tp)
        assert layer.weight.shape == (2 * inter // ws, IN)
        _load(layer.weight, up, 1)  # load order must not matter
        _load(layer.weight, gate, 0)
        g, u = layer.weight.chunk(2)
        n = inter // ws
        torch.testing.assert_close(g, gate[tp.rank * n : (tp.rank + 1) * n], rtol=0, atol=0)
        torch.testing.assert_close(u, up[tp.rank * n : (tp.rank + 1) * n], rtol=0, atol=0)
        return SiluAndMul()(layer(x))

    out = torch.cat(run_in_rank_threads(ws, rank), dim=-1)
    torch.testing.assert_close(out, F.silu(x @ gate.T) * (x @ up.T))


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_qkv_parallel_splits_heads(ws: int, gen: torch.Generator) -> None:
    heads, kv_heads, hd = 8, 4, 6
    q_w, k_w, v_w = (torch.randn(n * hd, IN, generator=gen) for n in (heads, kv_heads, kv_heads))
    q_b, k_b, v_b = (torch.randn(n * hd, generator=gen) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(5, IN, generator=gen)

    def rank(tp: TPGroup) -> tuple[torch.Tensor, ...]:
        layer = QKVParallelLinear(IN, hd, heads, kv_heads, bias=True, tp=tp)
        assert (layer.num_heads, layer.num_kv_heads) == (heads // ws, kv_heads // ws)
        for sid, w, b in (("v", v_w, v_b), ("q", q_w, q_b), ("k", k_w, k_b)):
            _load(layer.weight, w, sid)
            _load(layer.bias, b, sid)
        return layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)

    q, k, v = (torch.cat(parts, dim=-1) for parts in zip(*run_in_rank_threads(ws, rank), strict=True))
    torch.testing.assert_close(q, F.linear(x, q_w, q_b))
    torch.testing.assert_close(k, F.linear(x, k_w, k_b))
    torch.testing.assert_close(v, F.linear(x, v_w, v_b))


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_row_parallel_all_reduces_and_adds_bias_once(ws: int, gen: torch.Generator) -> None:
    w, b, x = (
        torch.randn(IN, OUT, generator=gen),
        torch.randn(IN, generator=gen),
        torch.randn(5, OUT, generator=gen),
    )

    def rank(tp: TPGroup) -> torch.Tensor:
        layer = RowParallelLinear(OUT, IN, bias=True, tp=tp)
        assert layer.weight.shape == (IN, OUT // ws)
        _load(layer.weight, w)
        _load(layer.bias, b)
        n = OUT // ws
        torch.testing.assert_close(layer.weight.data, w[:, tp.rank * n : (tp.rank + 1) * n], rtol=0, atol=0)
        return layer(x[:, tp.rank * n : (tp.rank + 1) * n])  # each rank sees its slice of the input

    for out in run_in_rank_threads(ws, rank):  # every rank ends with the full result
        torch.testing.assert_close(out, F.linear(x, w, b))


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("vocab", [12, 10])  # 10: not divisible by 4, the last shard is padded
def test_vocab_parallel_embedding_and_lm_head(ws: int, vocab: int, gen: torch.Generator) -> None:
    dim = 8
    emb_w, head_w = torch.randn(vocab, dim, generator=gen), torch.randn(vocab, dim, generator=gen)
    ids = torch.tensor([0, vocab - 1, 3, 5, 3, vocab // 2])
    hidden = torch.randn(4, dim, generator=gen)

    def rank(tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        emb = VocabParallelEmbedding(vocab, dim, tp)
        head = ParallelLMHead(vocab, dim, tp)
        tied = ParallelLMHead(vocab, dim, tp, tied_to=emb)
        assert emb.weight.shape == (-(-vocab // ws), dim)
        assert tied.weight is emb.weight
        _load(emb.weight, emb_w)
        _load(head.weight, head_w)
        return emb(ids), head.compute_logits(hidden), tied.compute_logits(hidden)

    results = run_in_rank_threads(ws, rank)
    for embedded, _, _ in results:
        torch.testing.assert_close(embedded, F.embedding(ids, emb_w))
    _, logits, tied_logits = results[0]
    torch.testing.assert_close(logits, hidden @ head_w.T)
    torch.testing.assert_close(tied_logits, hidden @ emb_w.T)
    assert all(r[1] is None and r[2] is None for r in results[1:])


def test_loaders_reject_mismatched_checkpoints() -> None:
    tp = TPGroup.single()
    col = ColumnParallelLinear(IN, OUT, bias=True, tp=tp)
    with pytest.raises(ValueError, match="entries along dim 0"):
        _load(col.weight, torch.zeros(OUT + 4, IN))
    with pytest.raises(ValueError, match="shape"):
        _load(col.bias, torch.zeros(OUT, 1))  # copy_ would broadcast this silently
    qkv = QKVParallelLinear(IN, 4, 4, 2, bias=False, tp=tp)
    with pytest.raises(ValueError, match="'q', 'k' or 'v'"):
        _load(qkv.weight, torch.zeros(16, IN), "o")
    merged = MergedColumnParallelLinear(IN, [8, 8], bias=False, tp=tp)
    with pytest.raises(ValueError, match="index"):
        _load(merged.weight, torch.zeros(8, IN), 2)
    emb = VocabParallelEmbedding(10, 4, tp)
    with pytest.raises(ValueError, match="vocab_size=10"):
        _load(emb.weight, torch.zeros(11, 4))
    with pytest.raises(ValueError, match="divisible"):
        QKVParallelLinear(IN, 4, 6, 3, bias=False, tp=TPGroup(0, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_and_fuses_residual(dtype: torch.dtype, gen: torch.Generator) -> None:
    x, res = torch.randn(5, 32, generator=gen).to(dtype), torch.randn(5, 32, generator=gen).to(dtype)
    weight = (1 + torch.randn(32, generator=gen)).to(dtype)
    ours, ref = RMSNorm(32, 1e-6).to(dtype), LlamaRMSNorm(32, eps=1e-6).to(dtype)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    # the torch code is exact against HF; `forward` (a fused kernel for float32 on the CPU, which may
    # work in place) sums the squares in another order, so it is held to float rounding
    torch.testing.assert_close(ours.forward_torch(x), ref(x), rtol=0, atol=0)
    normed, new_res = ours.forward_torch(x, res)
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref(x + res), rtol=0, atol=0)
    torch.testing.assert_close(ours(x), ref(x), rtol=2e-6, atol=1e-6)
    fwd_normed, fwd_res = ours(x.clone(), res.clone())
    torch.testing.assert_close(fwd_res, x + res, rtol=0, atol=0)
    torch.testing.assert_close(fwd_normed, ref(x + res), rtol=2e-6, atol=1e-6)


def test_silu_and_mul(gen: torch.Generator) -> None:
    x = torch.randn(3, 10, generator=gen)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    # head_dim 32 at theta 10000 puts frequencies in all three llama3 bands (kept, blended, scaled)
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rotary_matches_hf(case: str, gen: torch.Generator) -> None:
    head_dim, max_pos, theta = 32, 1024, 10000.0
    scaling = ROPE_CASES[case]
    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    if scaling is None:
        hf_inv, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        hf_inv, scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg)
    assert scale == 1.0
    torch.testing.assert_close(compute_inv_freq(head_dim, theta, scaling), hf_inv, rtol=0, atol=0)
    if case == "llama3":  # the case really hits all three bands
        ratio = hf_inv / LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)[0]
        assert (ratio == 1).any() and (ratio == 1 / 8).any() and ((ratio > 1 / 8) & (ratio < 1)).any()

    ours = RotaryEmbedding(head_dim, max_pos, theta, scaling)
    hf = LlamaRotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 1023, 3])  # packed rows: positions need not be sorted
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(len(positions), 4, head_dim, generator=gen).to(dtype)
        k = torch.randn(len(positions), 2, head_dim, generator=gen).to(dtype)
        cos, sin = hf(q, positions[None])  # [1, T, head_dim]
        ours_cos, ours_sin = ours.cos_sin(positions)
        torch.testing.assert_close(torch.cat([ours_cos, ours_cos], -1).to(dtype), cos[0], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([ours_sin, ours_sin], -1).to(dtype), sin[0], rtol=0, atol=0)
        # HF applies to [B, heads, T, d]; ours to packed [T, heads, d]
        ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        out_q, out_k = ours(positions, q, k)
        assert out_q.dtype == dtype
        torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), rtol=0, atol=0)


# Row counts that reach every tile of ops/csrc/panel_gemm.cpp: the AVX2 6-row and AVX-512 12-row bulk
# tiles, each remainder of 1-11 rows, and more than one 96-row block.
PANEL_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 25, 100, 197]


@pytest.mark.parametrize("rows", PANEL_ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (37, 24), (16, 8), (50, 1536)])
def test_panel_linear_matches_f_linear(rows: int, out_features: int, in_features: int) -> None:
    """The GEMM on 16-wide panels (last panel padded) equals F.linear, bias and strided rows included."""
    from model_exec.layers import cpu_gemm

    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    if not cpu_gemm.can_use_panels(weight):
        pytest.skip("the panel kernel needs the C++ kernels built with AVX2")
    bias = torch.randn(out_features, generator=gen)
    wide = torch.randn(rows, in_features + 8, generator=gen)
    x = wide[:, 4 : 4 + in_features]  # rows 8 floats apart: a strided view, as slices of a fused output are
    panels = cpu_gemm.pack_panels(weight)
    assert panels.shape == (-(-out_features // 16), in_features, 16)
    # fp32 sums of up to 1536 products in another order: differences of a few 1e-5 on values ~40
    tol = {"rtol": 1e-4, "atol": 2e-4}
    torch.testing.assert_close(cpu_gemm.panel_linear(x, panels, out_features, None), F.linear(x, weight), **tol)
    torch.testing.assert_close(cpu_gemm.panel_linear(x, panels, out_features, bias), F.linear(x, weight, bias), **tol)


_PANEL_BATCHES_SCRIPT = """
import sys, torch
from model_exec.layers import cpu_gemm
gen = torch.Generator().manual_seed(11)
weight, x = torch.randn(200, 576, generator=gen), torch.randn(230, 576, generator=gen)
assert cpu_gemm.can_use_panels(weight)  # loads the kernels
torch.save(cpu_gemm.panel_linear(x, cpu_gemm.pack_panels(weight), 200, None), sys.argv[1])
"""


def test_panel_linear_rows_do_not_depend_on_the_batch(tmp_path: Path) -> None:
    """A row's output has the same bits whatever rows share its call and however many threads split it
    (every element is one FMA chain over k in order), and the AVX-512 and AVX2 paths agree bit for bit:
    the batch jobs' re-runs rely on it."""
    from model_exec.layers import cpu_gemm

    gen = torch.Generator().manual_seed(11)
    weight, x = torch.randn(200, 576, generator=gen), torch.randn(230, 576, generator=gen)
    if not cpu_gemm.can_use_panels(weight):
        pytest.skip("the panel kernel needs the C++ kernels built with AVX2")
    panels = cpu_gemm.pack_panels(weight)
    whole = cpu_gemm.panel_linear(x, panels, 200, None)
    threads = torch.get_num_threads()
    try:  # one thread computes every panel: still the same chains, so the same bits
        torch.set_num_threads(1)
        assert torch.equal(cpu_gemm.panel_linear(x, panels, 200, None), whole)
    finally:
        torch.set_num_threads(threads)
    for rows in [*range(1, 30), 96, 97, 131]:
        assert torch.equal(cpu_gemm.panel_linear(x[:rows], panels, 200, None), whole[:rows]), rows
        assert torch.equal(cpu_gemm.panel_linear(x[-rows:], panels, 200, None), whole[-rows:]), rows
    paths = {}
    for name, extra_env in (("default", {}), ("avx2", {"RAYTP_CPU_NO_AVX512": "1"})):
        paths[name] = tmp_path / f"{name}.pt"
        env = {**os.environ, **extra_env}
        subprocess.run([sys.executable, "-c", _PANEL_BATCHES_SCRIPT, str(paths[name])], check=True, env=env, cwd=REPO)
    assert torch.equal(torch.load(paths["default"]), whole)
    assert torch.equal(torch.load(paths["avx2"]), whole)


@pytest.mark.parametrize(("out_features", "in_features", "rows"), [(200, 576, 230), (40, 4096, 530)])
def test_panel_linear_bulk_rows_equal_one_row_calls(out_features: int, in_features: int, rows: int) -> None:
    """The many-row road (AVX-512: x packed into 12-row strips, chunks of panels claimed by the threads,
    rows in slabs past 2M floats of x: 530 x 4096) has the bits of one-row calls, which take the
    decode tiles: the FMA chains, not the tiling, fix every bit. Strided rows, as a norm's output is not."""
    from model_exec.layers import cpu_gemm

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    if not cpu_gemm.can_use_panels(weight):
        pytest.skip("the panel kernel needs the C++ kernels built with AVX2")
    panels = cpu_gemm.pack_panels(weight)
    x = torch.randn(rows, in_features + 8, generator=gen)[:, 5 : 5 + in_features]
    whole = cpu_gemm.panel_linear(x, panels, out_features, None)
    one_by_one = torch.cat([cpu_gemm.panel_linear(x[r : r + 1], panels, out_features, None) for r in range(rows)])
    assert torch.equal(whole, one_by_one)
    gate_up = cpu_gemm.pack_panels(torch.cat([weight[:16], weight[-16:]]))  # one gate panel, one up panel
    gated = cpu_gemm.panel_linear_silu_mul(x, gate_up, 16)
    for r in (0, 11, 12, rows - 1):
        assert torch.equal(gated[r : r + 1], cpu_gemm.panel_linear_silu_mul(x[r : r + 1], gate_up, 16)), r


_GATED_SCRIPT = """
import sys, torch
from model_exec.layers import cpu_gemm
from ops import fused
gen = torch.Generator().manual_seed(5)
weight = torch.randn(2 * 96, 40, generator=gen) * 0.3
assert cpu_gemm.can_use_panels(weight)  # loads the kernels
panels = cpu_gemm.pack_panels(weight)
results = []
for rows in [*range(1, 26), 96, 97, 131]:
    x = torch.randn(rows, 48, generator=gen)[:, 3:43]  # strided rows, as a norm's output is not, to cover both
    two_steps = fused.silu_and_mul(cpu_gemm.panel_linear(x, panels, 192, None))
    fused_once = cpu_gemm.panel_linear_silu_mul(x, panels, 96)
    assert torch.equal(fused_once, two_steps), rows
    results.append(fused_once)
torch.save(results, sys.argv[1])
"""


def test_gated_panel_linear_equals_the_two_steps(tmp_path: Path) -> None:
    """silu(gate) * up in one kernel has the bits of panel_linear then silu_and_mul, for every tile shape
    (1-25 rows, row blocks), on the AVX-512 and AVX2 paths alike (each run in its own process: the kernels
    pick their ISA once per process)."""
    from model_exec.layers import cpu_gemm

    if not cpu_gemm.can_use_panels(torch.empty(16, 8)):
        pytest.skip("the panel kernel needs the C++ kernels built with AVX2")
    paths = {}
    for name, extra_env in (("default", {}), ("avx2", {"RAYTP_CPU_NO_AVX512": "1"})):
        paths[name] = tmp_path / f"{name}.pt"
        env = {**os.environ, **extra_env}
        subprocess.run([sys.executable, "-c", _GATED_SCRIPT, str(paths[name])], check=True, env=env, cwd=REPO)
    for a, b in zip(torch.load(paths["default"]), torch.load(paths["avx2"]), strict=True):
        assert torch.equal(a, b)


def test_gate_up_layer_fuses_its_activation_where_it_can() -> None:
    """GateUpParallelLinear.silu_and_mul = SiLU-and-mul of its projection, with and without a bias (the
    fused kernel takes none), packed into panels or oneDNN's layout, or dense."""
    from model_exec.layers.linear import GateUpParallelLinear

    gen = torch.Generator().manual_seed(9)
    for bias, pack in ((False, "panels"), (True, "panels"), (False, "onednn"), (False, "dense")):
        layer = GateUpParallelLinear(24, 32, bias=bias, tp=TPGroup.single())
        weight = torch.randn(64, 24, generator=gen)
        layer.weight.data.copy_(weight)
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(64, generator=gen))
        expected_weight, expected_bias = weight.clone(), None if layer.bias is None else layer.bias.detach().clone()
        if pack != "dense":
            layer.pack_weights(panels=pack == "panels")
        x = torch.randn(5, 24, generator=gen)
        y = F.linear(x, expected_weight, expected_bias)
        expected = F.silu(y[:, :32]) * y[:, 32:]
        torch.testing.assert_close(layer.silu_and_mul(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("panels", [True, False])
def test_linear_layers_pack_into_panels_or_onednn(panels: bool) -> None:
    """pack_weights() keeps one packed copy (panels, or oneDNN's with panels=False), releases the dense
    weight, and the layer still computes F.linear for any batch and leading dims."""
    from model_exec.layers import cpu_gemm
    from model_exec.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(64, 48, bias=True, tp=TPGroup.single())
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    layer.weight.data.copy_(weight)
    assert layer.bias is not None
    layer.bias.data.copy_(bias)
    if not (cpu_gemm.can_pack(weight) and cpu_gemm.can_use_panels(weight)):
        pytest.skip("needs oneDNN and the C++ kernels built with AVX2")
    assert layer.pack_weights(panels=panels)
    assert (layer.panel_weight is not None) == panels and (layer.packed_weight is not None) != panels
    assert layer.weight.stride() == (0, 0)  # the dense copy is released
    for shape in ((1, 64), (2, 64), (3, 64), (17, 64), (2, 5, 64)):
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
