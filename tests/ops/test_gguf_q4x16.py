"""The decode road on Q4_0 / Q4_1 rows repacked at load (ops/csrc/gguf_q4x16.cpp) against the file's layout and the
dequantized reference: the same integer dots and float sums in the same order, so the file-layout tiles' bits (odd
block counts too); each row's outputs do not depend on the other rows or on how N is cut (tensor-parallel slices);
prefill rows (the dequantizing road) never read the copy; the copy's bytes are the layout the kernel documents."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

from model_exec.layers.quantization.gguf import decode_pack, gguf_linear, kernels_available  # noqa: E402
from model_exec.layers.quantization.gguf_tensor import GGUFTensor  # noqa: E402
from tests.helpers.gguf_road import has_dequant_road, take_road  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C++ kernels' AVX2 build is not available")

Q4 = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]


def _blocks(n: int, k: int, qtype: object, seed: int) -> GGUFTensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01 * torch.randn(n, 1, generator=g)
    return GGUFTensor(torch.from_numpy(quantize(w.numpy(), qtype)), int(qtype), k)  # type: ignore[arg-type]


def _packed(w: GGUFTensor) -> torch.Tensor:
    packed = decode_pack(w.raw, w.qtype)
    if packed is None:
        pytest.skip("the packed decode road needs AVX-512 VNNI")
    return packed


@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 15])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 96), (80, 576), (32, 1536), (16, 224)])
def test_packed_rows_match_the_file_layout_and_the_reference(
    monkeypatch: pytest.MonkeyPatch, qtype: object, rows: int, n: int, k: int
) -> None:
    take_road(monkeypatch, "int")
    w = _blocks(n, k, qtype, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
    y = gguf_linear(x, w.raw, w.qtype, _packed(w))
    assert torch.equal(y, gguf_linear(x, w.raw, w.qtype))
    # x's 16-bit grid (tests/ops/test_gguf_gemm.py's bound for Q4_0 / Q4_1)
    reference = x @ w.dequantize().T
    assert float((y - reference).abs().max()) <= 1e-4 * float(reference.abs().max())


@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
def test_a_rows_outputs_do_not_depend_on_other_rows_or_column_cuts(qtype: object) -> None:
    """Bit-identical whatever the other rows of the step and however N is cut (TP column slices: 16-row multiples)."""
    w = _blocks(64, 192, qtype, seed=5)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(5))
    whole = gguf_linear(x, w.raw, w.qtype, _packed(w))
    one_by_one = torch.cat([gguf_linear(x[m : m + 1], w.raw, w.qtype, _packed(w)) for m in range(5)])
    assert torch.equal(whole, one_by_one)
    halves = [GGUFTensor(w.raw[32 * r : 32 * (r + 1)].contiguous(), w.qtype, 192) for r in range(2)]
    cols = torch.cat([gguf_linear(x, h.raw, h.qtype, _packed(h)) for h in halves], dim=-1)
    assert torch.equal(cols, whole)
    # row-parallel: K halves at a block boundary, each packed on its own, sum to the full product
    k_halves = [
        GGUFTensor(w.raw.view(64, 6, -1)[:, 3 * r : 3 * (r + 1)].contiguous().view(64, -1), w.qtype, 96)
        for r in range(2)
    ]
    xs = [x[:, 96 * r : 96 * (r + 1)].contiguous() for r in range(2)]
    parts = [gguf_linear(xr, h.raw, h.qtype, _packed(h)) for xr, h in zip(xs, k_halves, strict=True)]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-4, atol=1e-4 * float(whole.abs().max()))


@pytest.mark.skipif(not has_dequant_road, reason="the dequantizing road needs AVX-512F")
def test_prefill_rows_take_the_file_layout() -> None:
    w = _blocks(32, 96, gguf.GGMLQuantizationType.Q4_1, seed=9)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(9))
    assert torch.equal(gguf_linear(x, w.raw, w.qtype, _packed(w)), gguf_linear(x, w.raw, w.qtype))


@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
def test_the_copy_is_the_documented_layout(qtype: object) -> None:
    """Per group of 16 rows and block: byte 4 v + t of row j's nibbles at 64 v + 4 j + t, then the 16 d (and m)."""
    w = _blocks(32, 64, qtype, seed=2)
    packed = _packed(w)
    q4_1 = qtype == gguf.GGMLQuantizationType.Q4_1
    raw = w.raw.view(2, 16, 2, 20 if q4_1 else 18)  # [group, row, block, bytes]
    nibbles = raw[..., 4 if q4_1 else 2 :].reshape(2, 16, 2, 4, 4).permute(0, 2, 3, 1, 4).reshape(2, 2, 256)
    scales = [raw[..., 0:2], raw[..., 2:4]] if q4_1 else [raw[..., 0:2]]
    tails = [s.permute(0, 2, 1, 3).reshape(2, 2, 32) for s in scales]
    assert torch.equal(packed.view(2, 2, -1), torch.cat([nibbles, *tails], dim=-1))


def test_what_has_no_packed_layout_keeps_the_file_alone() -> None:
    q4 = _blocks(16, 64, gguf.GGMLQuantizationType.Q4_1, seed=1)
    _packed(q4)  # skips where the CPU has no VNNI
    assert decode_pack(_blocks(24, 64, gguf.GGMLQuantizationType.Q4_1, seed=1).raw, q4.qtype) is None  # N % 16
    q8 = _blocks(24, 64, gguf.GGMLQuantizationType.Q8_0, seed=1)
    assert decode_pack(q8.raw, q8.qtype) is None  # N % 16 (Q8_0's own copy: gguf_q8x16.cpp)
    with pytest.raises(RuntimeError, match="packed copy does not match"):  # a Q4 copy given to Q8_0 rows
        gguf_linear(torch.randn(1, 64), q8.raw[:16].contiguous(), q8.qtype, _packed(q4))
    other = _blocks(32, 64, gguf.GGMLQuantizationType.Q4_1, seed=3)
    with pytest.raises(RuntimeError, match="packed copy does not match"):
        gguf_linear(torch.randn(1, 64), other.raw, other.qtype, _packed(q4))
