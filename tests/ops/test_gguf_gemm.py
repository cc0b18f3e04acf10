"""The GGUF block kernel (ops/csrc/gguf_gemm.cpp) against the dequantized reference, per kernel type.

Blocks come from the `gguf` package's own quantizer. Two references: an exact model of the integer tiles'
arithmetic (x quantized per 32-block to int8, integer dots, in float64) that they must match to float32
rounding, and the plain product with the dequantized weights (the float path a GGUF used to load as), which
they must match to the int8 activations' rounding and the dequantizing road (prefill) to float32 rounding;
each road runs at every row count (tests/helpers/gguf_road.py). Odd shapes (N not a multiple of anything,
one block of K), decode (1-4 rows) and prefill (many rows, the 4-row tiles and their remainder), tensor-parallel slices
(row-parallel cuts along K at block boundaries, column-parallel along N).
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

from model_exec.layers.quantization.gguf import decode_pack, gguf_linear, kernels_available  # noqa: E402
from model_exec.layers.quantization.gguf_tensor import GGUFTensor, dequantize_rows  # noqa: E402
from model_exec.layers.quantization.row_roads import INTEGER  # noqa: E402
from tests.helpers.gguf_road import DEQUANT_ROWS, ROADS, has_dequant_road, take_road  # noqa: E402
from tests.helpers.isa import needs_avx512, rerun_on_avx2  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C++ kernels' AVX2 build is not available")

TYPES = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]


def _blocks(n: int, k: int, qtype: object, seed: int) -> GGUFTensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01 * torch.randn(n, 1, generator=g)  # per-row offsets: Q4_1's min
    return GGUFTensor(torch.from_numpy(quantize(w.numpy(), qtype)), int(qtype), k)  # type: ignore[arg-type]


TWO_BYTE_X = (int(gguf.GGMLQuantizationType.Q4_0), int(gguf.GGMLQuantizationType.Q4_1))


def _emulated(x: torch.Tensor, w: GGUFTensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: x per 32-block on a grid of step dx = max|x| / 127 (int8; Q8_0), or
    dx / 256 (16 bits; Q4_0, Q4_1), round half to even; w's blocks."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127.0
    step = dx / 256.0 if w.qtype in TWO_BYTE_X else dx
    qx = torch.where(dx > 0, torch.round(xb / torch.where(dx > 0, step, 1.0)), 0.0)
    x_hat = (qx * step).double().view(m, k)
    if w.qtype == int(gguf.GGMLQuantizationType.Q4_1):  # the offset term uses the float x, not its int8 image
        rows = w.raw.shape[0]
        mins = w.raw.view(rows, k // 32, 20)[..., 2:4].contiguous().view(torch.float16).double()  # [N, nb, 1]
        w_scaled = dequantize_rows(w.raw, w.qtype, k).double().view(rows, k // 32, 32) - mins
        return (x_hat @ w_scaled.view(rows, k).T + xb.sum(-1).double() @ mins.squeeze(-1).T).float()
    return (x_hat @ w.dequantize().double().T).float()


@pytest.mark.parametrize("road", ROADS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13, 64, 131])
@pytest.mark.parametrize(("n", "k"), [(37, 32), (77, 576), (16, 1536)])
def test_gguf_linear_matches_the_dequantized_reference(
    monkeypatch: pytest.MonkeyPatch, road: str, qtype: object, rows: int, n: int, k: int
) -> None:
    take_road(monkeypatch, road)
    w = _blocks(n, k, qtype, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = gguf_linear(x, w.raw, w.qtype)
    reference = x @ w.dequantize().T
    if road == "dequant":  # the dequantized weights themselves, fp32 accumulation in k order
        torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
        return
    torch.testing.assert_close(y, _emulated(x, w), rtol=1e-4, atol=1e-4 * float(y.abs().max()))
    # x's rounding: int8's 1/254 of a block's range, or 16 bits' 1/65024
    bound = 1e-4 if int(qtype) in TWO_BYTE_X else 0.03  # type: ignore[call-overload]
    assert float((y - reference).abs().max()) <= bound * float(reference.abs().max())


@pytest.mark.parametrize("rows", [1, 3, 4, 64])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 576), (32, 1536), (16, 224)])
def test_q8_0s_packed_copy_matches_the_reference(rows: int, n: int, k: int) -> None:
    """The Q8_0 integer road on its repacked copy (ops/csrc/gguf_q8x16.cpp): the exact model of the integer
    arithmetic to float32 rounding, the dequantized product to x's int8 rounding; a column cut (tensor-parallel
    slice, 16-row multiples) packed on its own gives the whole product's columns, bit for bit."""
    w = _blocks(n, k, gguf.GGMLQuantizationType.Q8_0, seed=n + k)
    packed = decode_pack(w.raw, w.qtype)
    if packed is None:
        pytest.skip("the packed Q8_0 road needs AVX-512 VNNI")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = gguf_linear(x, w.raw, w.qtype, packed, INTEGER)
    torch.testing.assert_close(y, _emulated(x, w), rtol=1e-4, atol=1e-4 * float(y.abs().max()))
    reference = x @ w.dequantize().T
    assert float((y - reference).abs().max()) <= 0.03 * float(reference.abs().max())
    first = w.raw[:16].contiguous()
    assert torch.equal(gguf_linear(x, first, w.qtype, decode_pack(first, w.qtype), INTEGER), y[:, :16])


@pytest.mark.parametrize("road", ROADS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tensor_parallel_slices_are_the_full_products_parts(
    monkeypatch: pytest.MonkeyPatch, road: str, qtype: object
) -> None:
    """Row-parallel: the two ranks' K halves (cut at a block boundary) sum to the full product, each its
    own blocks; column-parallel: N halves side by side."""
    take_road(monkeypatch, road)
    w = _blocks(48, 192, qtype, seed=3)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(5))
    halves = [w.narrow(1, 96 * r, 96) for r in range(2)]
    assert all(isinstance(h, GGUFTensor) for h in halves)
    parts = [
        gguf_linear(x[:, 96 * r : 96 * (r + 1)].contiguous(), h.raw.contiguous(), h.qtype) for r, h in enumerate(halves)
    ]  # type: ignore[union-attr]
    full = _emulated(x, w) if road == "int" else x @ w.dequantize().T
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-4, atol=1e-4)
    cols = torch.cat([gguf_linear(x, part.raw.contiguous(), part.qtype) for part in w.split([24, 24])], dim=-1)
    torch.testing.assert_close(cols, gguf_linear(x, w.raw, w.qtype), rtol=0, atol=0)
    # a cut between blocks cannot keep blocks: the exact floats come instead
    inside = w.narrow(1, 16, 64)
    assert isinstance(inside, torch.Tensor)
    torch.testing.assert_close(inside, w.dequantize()[:, 16:80], rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 96, 576])
def test_a_decode_rows_outputs_do_not_depend_on_its_neighbours(qtype: object, k: int) -> None:
    """One row of x: the decode tile that runs several output features per pass (Q4_0 / Q4_1) gives each feature
    the same bits as computing it alone (one feature: the one-feature tile), whatever N % 4 leaves over."""
    w = _blocks(37, k, qtype, seed=k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
    whole = gguf_linear(x, w.raw, w.qtype)
    alone = torch.cat([gguf_linear(x, w.raw[n : n + 1].contiguous(), w.qtype) for n in range(37)], dim=-1)
    assert torch.equal(whole, alone)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_is_the_gguf_packages_dequantization(qtype: object) -> None:
    w = _blocks(9, 96, qtype, seed=11)
    torch.testing.assert_close(dequantize_rows(w.raw, w.qtype, 96), w.dequantize(), rtol=0, atol=0)


@pytest.mark.skipif(not has_dequant_road, reason="the dequantizing road needs AVX-512F")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_road_follows_the_row_count(monkeypatch: pytest.MonkeyPatch, qtype: object) -> None:
    """Unset, the threshold is kDequantRows: one row fewer takes the integer tiles, from there the dequantizing road."""
    w = _blocks(40, 576, qtype, seed=7)
    x = torch.randn(DEQUANT_ROWS, 576, generator=torch.Generator().manual_seed(7))
    monkeypatch.delenv("RAYTP_GGUF_DEQUANT_ROWS", raising=False)
    default = [gguf_linear(x[:rows], w.raw, w.qtype) for rows in (DEQUANT_ROWS - 1, DEQUANT_ROWS)]
    for road, rows, got in (("int", DEQUANT_ROWS - 1, default[0]), ("dequant", DEQUANT_ROWS, default[1])):
        take_road(monkeypatch, road)
        torch.testing.assert_close(got, gguf_linear(x[:rows], w.raw, w.qtype), rtol=0, atol=0)
    take_road(monkeypatch, "int")
    assert not torch.equal(default[1], gguf_linear(x, w.raw, w.qtype))  # the roads do differ in their bits


def test_bad_inputs_are_refused() -> None:
    w = _blocks(8, 64, TYPES[0], seed=0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.raytp_cpu.gguf_linear(torch.randn(1, 40), w.raw, w.qtype)
    with pytest.raises(RuntimeError, match="bytes"):
        torch.ops.raytp_cpu.gguf_linear(torch.randn(1, 96), w.raw, w.qtype)
    with pytest.raises(RuntimeError, match="no kernel"):
        torch.ops.raytp_cpu.gguf_linear(torch.randn(1, 64), w.raw, 6)  # Q5_0
    with pytest.raises(RuntimeError, match="out must be"):
        gguf_linear(torch.randn(2, 64), w.raw, w.qtype, out=torch.empty(2, 9))
    out = torch.full((3, 8), float("nan"))  # written in place, rows 1 and 2 of it
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    gguf_linear(x, w.raw, w.qtype, out=out.narrow(0, 1, 2))
    assert torch.equal(out[1:], gguf_linear(x, w.raw, w.qtype)) and out[0].isnan().all()


@needs_avx512
def test_avx2_code_passes_too() -> None:
    """The AVX-512 VNNI tiles run above where the CPU has them; this reruns the module on the AVX2 tiles."""
    rerun_on_avx2(__file__, "test_avx2_code_passes_too")
