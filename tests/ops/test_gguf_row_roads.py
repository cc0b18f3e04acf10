"""A row's GGUF road is its kind's, not its step's (model_exec/layers/quantization/row_roads.py): on each road a row's
outputs are bit-identical whatever rows share the call (counts across every tile and remainder, and the switch
between the one-row and many-row tiles), for every kernel type and the Q4 decode copy; a step's mixed rows split
by kind give each row its road's bits; the `road` argument overrides the row count and its environment variable.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

from model_exec.layers.quantization import row_roads  # noqa: E402
from model_exec.layers.quantization.gguf import (  # noqa: E402
    decode_pack,
    gguf_linear,
    gguf_rows_linear,
    kernels_available,
)
from tests.helpers.gguf_road import DEQUANT_ROWS, has_dequant_road  # noqa: E402
from tests.helpers.kquants import quantize_kquant  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C++ kernels' AVX2 build is not available")

T = gguf.GGMLQuantizationType
K = 512  # two K-quant super-blocks, 16 32-blocks
ROAD_IDS = {row_roads.INTEGER: "integer", row_roads.DEQUANT: "dequant"}
ROADS = [
    row_roads.INTEGER,
    pytest.param(
        row_roads.DEQUANT,
        marks=pytest.mark.skipif(not has_dequant_road, reason="the dequantizing road needs AVX-512F"),
    ),
]


def _weights(qtype: T, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the block rows, their Q4 decode copy or None)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, K, generator=g) * 0.05 + 0.01 * torch.randn(n, 1, generator=g)).numpy()
    if qtype in (T.Q4_K, T.Q6_K):
        raw = torch.from_numpy(quantize_kquant(w, int(qtype)))
    else:
        raw = torch.from_numpy(quantize(w, qtype))  # type: ignore[arg-type]
    return raw, decode_pack(raw, int(qtype))  # None for the K-quants, and without AVX-512 VNNI


@pytest.mark.parametrize("road", ROADS, ids=lambda r: ROAD_IDS[r])
@pytest.mark.parametrize("layout", ["file", "packed"])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(
    monkeypatch: pytest.MonkeyPatch, road: int, layout: str, qtype: T
) -> None:
    """Row i alone, and inside calls of 2..40 rows (across the 4-row and 12-row tiles, Q8_0's row tiles, and
    kDequantRows), gives the same bits, on the file's rows and on the repacked copy; the environment's threshold
    is not read."""
    monkeypatch.setenv("RAYTP_GGUF_DEQUANT_ROWS", "3")  # would flip a by-row-count call at 3 rows
    raw, packed = _weights(qtype, 48, seed=int(qtype))
    if layout == "packed" and packed is None:
        pytest.skip(f"{qtype.name} has no packed copy here (K-quants; Q4 / Q8_0 without AVX-512 VNNI)")
    use = packed if layout == "packed" else None
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([gguf_linear(x[m : m + 1], raw, int(qtype), use, road) for m in range(40)])
    for rows in (2, 3, 4, 5, 7, DEQUANT_ROWS - 1, DEQUANT_ROWS, 25, 40):
        got = gguf_linear(x[:rows], raw, int(qtype), use, road)
        assert torch.equal(got, alone[:rows]), f"{rows} rows"
    if use is not None and qtype != T.Q8_0:  # the Q4 copy keeps the file-layout tiles' bits (gguf_q4x16.cpp)
        assert torch.equal(gguf_linear(x, raw, int(qtype), None, road), alone)


@pytest.mark.skipif(not has_dequant_road, reason="the dequantizing road needs AVX-512F")
@pytest.mark.parametrize("layout", ["runs", "interleaved"])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_a_step_splits_its_rows_by_kind(layout: str, qtype: T) -> None:
    """A mixed step (prompt rows beside generated rows: in a few runs, each written in place, or interleaved,
    gathered): each row gets its own road's bits; a step of one kind runs one call on that road; no step: by row
    count."""
    raw, packed = _weights(qtype, 32, seed=5)
    x = torch.randn(21, K, generator=torch.Generator().manual_seed(5))
    if layout == "runs":  # decode rows, a prompt chunk, decode rows
        generated = torch.tensor([i < 3 or i >= 17 for i in range(21)])
        assert len(row_roads.StepRoads.of(generated).runs) == 3
    else:
        generated = torch.tensor([i % 3 == 0 for i in range(21)])
        assert not row_roads.StepRoads.of(generated).runs
    integer = gguf_linear(x, raw, int(qtype), packed, row_roads.INTEGER)
    dequant = gguf_linear(x, raw, int(qtype), packed, row_roads.DEQUANT)
    assert not torch.equal(integer, dequant)  # the roads' bits do differ, so the checks below can fail
    with row_roads.step(generated):
        mixed = gguf_rows_linear(x, raw, int(qtype), packed)
        # a call over some other set of rows than the step's falls back to the row count
        assert torch.equal(gguf_rows_linear(x[:2], raw, int(qtype), packed), integer[:2])
    assert torch.equal(mixed[generated], integer[generated])
    assert torch.equal(mixed[~generated], dequant[~generated])
    with row_roads.step(torch.ones(21, dtype=torch.bool)):
        assert torch.equal(gguf_rows_linear(x, raw, int(qtype), packed), integer)
    with row_roads.step(torch.zeros(3, dtype=torch.bool)):
        assert torch.equal(gguf_rows_linear(x[:3], raw, int(qtype), packed), dequant[:3])
    assert row_roads.for_rows(21) is None  # the step ended with its block
    assert torch.equal(gguf_rows_linear(x, raw, int(qtype), packed), dequant)  # 21 rows >= kDequantRows


def test_step_roads_of_a_mask() -> None:
    assert row_roads.StepRoads.of(torch.tensor([True, True])).road == row_roads.INTEGER
    assert row_roads.StepRoads.of(torch.tensor([False])).road == row_roads.DEQUANT
    runs = row_roads.StepRoads.of(torch.tensor([True, False, False, True, True]))
    assert runs.road == row_roads.BY_ROWS and runs.num_rows == 5
    assert runs.runs == ((0, 1, row_roads.INTEGER), (1, 2, row_roads.DEQUANT), (3, 2, row_roads.INTEGER))
    mixed = row_roads.StepRoads.of(torch.tensor([False, True, False, True, False, True]))  # 6 runs
    assert mixed.road == row_roads.BY_ROWS and not mixed.runs
    assert mixed.generated is not None and mixed.generated.tolist() == [1, 3, 5]
    assert mixed.prompt is not None and mixed.prompt.tolist() == [0, 2, 4]


def test_an_unknown_road_is_refused() -> None:
    raw, packed = _weights(T.Q8_0, 16, seed=1)
    with pytest.raises(RuntimeError, match="unknown road 7"):
        gguf_linear(torch.randn(1, K), raw, int(T.Q8_0), packed, 7)
