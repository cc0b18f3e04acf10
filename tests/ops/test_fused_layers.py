"""The fused CPU kernels (ops/fused.py) against the torch reference code of the model layers.

Row counts 1 (a single decode), a few, and many (enough to split over threads); widths that are
and are not multiples of the 8-float vector; strided inputs as the model hands them over (the
q|k part of a fused qkv projection, cos/sin as views of the cached table). Rotary and the residual
add must match bit for bit; RMSNorm (another summation order) and SiLU (another exp) within a few
float32 ulp.
"""

from __future__ import annotations

import pytest
import torch

from model_exec.layers.activation import SiluAndMul
from model_exec.layers.norm import RMSNorm
from model_exec.layers.rotary import RotaryEmbedding
from ops import fused

ROWS = [1, 3, 200]  # 200 rows x 576 floats (115K) crosses the kernels' 32K-float threading threshold


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    from ops.attention import cpu_kernels

    error = cpu_kernels.load_error()
    if error is not None:
        pytest.skip(error)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _norm(width: int, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(width, 1e-5)
    norm.weight.data.copy_(1 + torch.randn(width, generator=gen))
    return norm


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 37])
def test_rms_norm_matches_torch(rows: int, width: int, gen: torch.Generator) -> None:
    norm = _norm(width, gen)
    x = torch.randn(rows, width, generator=gen) * 3
    assert fused.applies(x, norm.weight)
    out = norm(x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, norm.forward_torch(x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 37])
def test_fused_add_rms_norm_matches_torch_in_place(rows: int, width: int, gen: torch.Generator) -> None:
    norm = _norm(width, gen)
    x, residual = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    ref_normed, ref_residual = norm.forward_torch(x, residual)
    x_in, residual_in = x.clone(), residual.clone()
    normed, new_residual = norm(x_in, residual_in)
    assert normed.data_ptr() == x_in.data_ptr() and new_residual.data_ptr() == residual_in.data_ptr()
    torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, rtol=2e-6, atol=1e-6)


def test_norms_take_leading_dims_and_strided_rows(gen: torch.Generator) -> None:
    norm = _norm(64, gen)
    x = torch.randn(2, 3, 64, generator=gen)
    torch.testing.assert_close(norm(x), norm.forward_torch(x), rtol=2e-6, atol=1e-6)
    wide = torch.randn(5, 100, generator=gen)
    rows = wide[:, 10:74]  # row stride 100, last dim contiguous
    out = norm(rows)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, norm.forward_torch(rows), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", ROWS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 20)])
def test_rotary_in_place_on_the_qk_view_is_exact(
    tokens: int, heads: tuple[int, int, int], gen: torch.Generator
) -> None:
    num_heads, num_kv_heads, head_dim = heads
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    angles = rotary.angles(positions, torch.float32)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen)
    qk = qkv[:, : q_size + kv_size].view(tokens, num_heads + num_kv_heads, head_dim)
    expected = rotary.rotate(angles, qk)
    v_before = qkv[:, q_size + kv_size :].clone()

    rotated = rotary.rotate_owned(angles, qk)

    assert rotated.data_ptr() == qkv.data_ptr() and rotated.stride() == qk.stride()
    torch.testing.assert_close(rotated, expected, rtol=0, atol=0)
    torch.testing.assert_close(qkv[:, q_size + kv_size :], v_before, rtol=0, atol=0)  # v untouched


def test_rotary_takes_contiguous_angle_rows(gen: torch.Generator) -> None:
    cos, sin = torch.rand(4, 8, generator=gen), torch.rand(4, 8, generator=gen)
    x = torch.randn(4, 3, 16, generator=gen)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch.testing.assert_close(fused.rotate_half_rope_(x, cos, sin), expected, rtol=0, atol=0)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 13])
def test_silu_and_mul_matches_torch(rows: int, width: int, gen: torch.Generator) -> None:
    x = torch.randn(rows, 2 * width, generator=gen) * 4
    x[0, :4] = torch.tensor([-120.0, -60.0, 0.0, 60.0])  # saturated and zero gates
    out = SiluAndMul()(x)
    assert out.shape == (rows, width)
    torch.testing.assert_close(out, SiluAndMul.forward_torch(x), rtol=1e-6, atol=1e-7)


def test_other_dtypes_keep_the_torch_code(gen: torch.Generator) -> None:
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    norm = RMSNorm(32, 1e-6, torch.bfloat16)
    assert not fused.applies(x, norm.weight)
    torch.testing.assert_close(norm(x), norm.forward_torch(x), rtol=0, atol=0)
    torch.testing.assert_close(SiluAndMul()(x), SiluAndMul.forward_torch(x), rtol=0, atol=0)


def test_kernels_reject_bad_shapes(gen: torch.Generator) -> None:
    x = torch.randn(2, 10, generator=gen)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        torch.ops.raytp_cpu.rms_norm(torch.empty(2, 10), x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.raytp_cpu.rms_norm(torch.empty(2, 10), x.double(), torch.ones(10), 1e-6)
    with pytest.raises(RuntimeError, match="one row of head_dim/2"):
        torch.ops.raytp_cpu.rotate_half_rope(torch.randn(2, 1, 8), torch.ones(2, 3), torch.ones(2, 3))


def test_a_failed_build_keeps_the_torch_code(monkeypatch: pytest.MonkeyPatch, gen: torch.Generator) -> None:
    from ops.attention import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load_error", lambda: "no compiler here")
    norm = _norm(16, gen)
    x, residual = torch.randn(2, 16, generator=gen), torch.randn(2, 16, generator=gen)
    assert not fused.applies(x)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = norm(x, residual)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)  # the torch path never works in place
    torch.testing.assert_close(residual, residual_before, rtol=0, atol=0)
    ref_normed, ref_residual = norm.forward_torch(x, residual)
    torch.testing.assert_close(normed, ref_normed, rtol=0, atol=0)
    torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)
    rotary = RotaryEmbedding(8, 64, 10000.0)
    qk = torch.randn(2, 3, 8, generator=gen)
    angles = rotary.angles(torch.tensor([0, 5]), torch.float32)
    rotated = rotary.rotate_owned(angles, qk)
    assert rotated.data_ptr() != qk.data_ptr()
    torch.testing.assert_close(rotated, rotary.rotate(angles, qk), rtol=0, atol=0)
