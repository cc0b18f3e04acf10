"""The Q4_K / Q6_K kernels (ops/csrc/gguf_kquants.cpp, through gguf_linear) against the dequantized reference.

The `gguf` package dequantizes these types but cannot quantize them, so blocks come from the tests' numpy
writer (tests/helpers/kquants.py), itself checked against the package's `dequantize`. References as in
test_gguf_gemm.py: an exact model of the kernel's arithmetic (x per 32-block in int8, integer dots, float64),
matched to float32 rounding, and the plain product with the dequantized weights, matched to the int8
activations' rounding; the dequantizing (prefill) road matches the latter to float32 rounding, each road at
every row count (tests/helpers/gguf_road.py). Decode (1-4 rows) and prefill (the 4-row tiles and their
remainder), odd N, one and several super-blocks of K, tensor-parallel cuts on and inside super-blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import Q4_K, dequantize  # noqa: E402

from model_exec.layers.quantization.gguf import gguf_linear, kernels_available  # noqa: E402
from model_exec.layers.quantization.gguf_tensor import GGUFTensor, dequantize_rows  # noqa: E402
from tests.helpers.gguf_road import ROADS, take_road  # noqa: E402
from tests.helpers.kquants import quantize_kquant  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C++ kernels' AVX2 build is not available")

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_K, T.Q6_K]


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # per-row offsets (Q4_K's mins) and a few loud columns (sub-blocks with different scales)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01 * torch.randn(n, 1, generator=g)
    return w * (1.0 + 3.0 * (torch.rand(1, k, generator=g) > 0.9))


def _blocks(n: int, k: int, qtype: T, seed: int) -> GGUFTensor:
    return GGUFTensor(torch.from_numpy(quantize_kquant(_weights(n, k, seed).numpy(), int(qtype))), int(qtype), k)


def _q4_k_mins(w: GGUFTensor) -> torch.Tensor:
    """dmin * m per 32-weight sub-block, [N, K / 32] float64 (the `gguf` package's own scale unpacking)."""
    blocks = w.raw.numpy().reshape(-1, 144)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    _, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return torch.from_numpy((dmin * m.astype(np.float32)).astype(np.float64)).reshape(w.raw.shape[0], -1)


def _emulated(x: torch.Tensor, w: GGUFTensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: x per 32-block in int8 (round half to even) times w's integers
    with their scales; Q4_K's min term on the float sums of x."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127.0
    x_hat = (torch.where(dx > 0, torch.round(xb / torch.where(dx > 0, dx, 1.0)), 0.0) * dx).double().view(m, k)
    dense = w.dequantize().double()
    if w.qtype != int(T.Q4_K):
        return (x_hat @ dense.T).float()
    mins = _q4_k_mins(w)  # [N, nb]
    scaled = dense + mins.repeat_interleave(32, dim=1)  # d sc q alone
    return (x_hat @ scaled.T - xb.sum(-1).double() @ mins.T).float()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_test_blocks_are_ggml_layout(qtype: T) -> None:
    """The numpy writer's blocks, read back by the `gguf` package, give the weights back to 4/6-bit rounding
    (a byte or nibble out of place gives errors of the weights' own size)."""
    w = _weights(23, 512, seed=1)
    raw = quantize_kquant(w.numpy(), int(qtype))
    assert raw.shape == (23, 2 * (144 if qtype == T.Q4_K else 210))
    back = torch.from_numpy(dequantize(raw, qtype)).reshape(23, 512)
    err = (back - w).abs().amax() / w.abs().amax()
    assert float(err) < (0.07 if qtype == T.Q4_K else 0.02), err
    assert float(torch.corrcoef(torch.stack((back.flatten(), w.flatten())))[0, 1]) > (
        0.99 if qtype == T.Q4_K else 0.999
    )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_is_the_gguf_packages_dequantization(qtype: T) -> None:
    w = _blocks(9, 768, qtype, seed=11)
    torch.testing.assert_close(dequantize_rows(w.raw, w.qtype, 768), w.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("road", ROADS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 64, 131])
@pytest.mark.parametrize(("n", "k"), [(37, 256), (77, 768), (16, 1536)])
def test_kquant_linear_matches_the_dequantized_reference(
    monkeypatch: pytest.MonkeyPatch, road: str, qtype: T, rows: int, n: int, k: int
) -> None:
    take_road(monkeypatch, road)
    w = _blocks(n, k, qtype, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = gguf_linear(x, w.raw, w.qtype)
    reference = x @ w.dequantize().T
    if road == "dequant":  # the dequantized weights themselves (prefill's road), fp32 accumulation
        torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
        return
    torch.testing.assert_close(y, _emulated(x, w), rtol=1e-4, atol=1e-4 * float(y.abs().max()))
    # x's int8 rounding meets Q4_K's unsigned d sc q (its mins are applied on the float x): ~1.5% of the
    # output's norm there, ~0.5% for Q6_K; a wrong scale or layout is off by the output's own size
    assert float((y - reference).norm()) <= 0.03 * float(reference.norm())


@pytest.mark.parametrize("road", ROADS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tensor_parallel_cuts(monkeypatch: pytest.MonkeyPatch, road: str, qtype: T) -> None:
    """Row-parallel: K halves cut on a super-block boundary keep blocks and sum to the full product;
    column-parallel: N halves side by side; a cut inside a super-block (on a 32-boundary, where the 32-block
    types would keep blocks) gives the exact floats instead."""
    take_road(monkeypatch, road)
    w = _blocks(40, 512, qtype, seed=3)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5))
    halves = [w.narrow(1, 256 * r, 256) for r in range(2)]
    assert all(isinstance(h, GGUFTensor) for h in halves)
    parts = [
        gguf_linear(x[:, 256 * r : 256 * (r + 1)].contiguous(), h.raw.contiguous(), h.qtype)  # type: ignore[union-attr]
        for r, h in enumerate(halves)
    ]
    full = _emulated(x, w) if road == "int" else x @ w.dequantize().T
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-4, atol=1e-4)
    cols = torch.cat([gguf_linear(x, part.raw.contiguous(), part.qtype) for part in w.split([17, 23])], dim=-1)
    torch.testing.assert_close(cols, gguf_linear(x, w.raw, w.qtype), rtol=0, atol=0)
    for start, length in ((128, 256), (0, 128), (256, 96)):
        inside = w.narrow(1, start, length)
        assert isinstance(inside, torch.Tensor)
        torch.testing.assert_close(inside, w.dequantize()[:, start : start + length], rtol=0, atol=0)


def test_bad_inputs_are_refused() -> None:
    w = _blocks(8, 256, T.Q4_K, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.raytp_cpu.gguf_linear(torch.randn(1, 96), w.raw[:, :96].contiguous(), w.qtype)
    with pytest.raises(RuntimeError, match="bytes"):
        torch.ops.raytp_cpu.gguf_linear(torch.randn(1, 512), w.raw, w.qtype)
    with pytest.raises(ValueError, match="256-weight Q6_K"):
        GGUFTensor(torch.zeros(2, 210, dtype=torch.uint8), int(T.Q6_K), 224)
