"""The Triton layer kernels (ops/triton_layers.py) against the unfused torch ops, through Triton's interpreter.

Run as a child process by tests/ops/test_triton_layers.py with TRITON_INTERPRET=1 (the interpreter is chosen
when triton first loads). The layers' CUDA branch is opened to CPU tensors here (`fused_cuda.interpret_on_cpu`)
and raytp's C++ CPU kernels are reported unavailable, so each layer's `forward` runs the Triton kernel and its
torch reference runs plain torch. Cases: RMSNorm (Llama and Gemma rounding, with and without the residual add),
rotary (full and partial, on a strided q|k view), SiLU-and-mul, each in float32, float16 and bfloat16; then the
tiny Llama and Qwen2 whole, their prefill logits with the kernels against without. Prints one JSON object:
case id -> null (passed) or the failure text.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import torch

from model_exec.layers.activation import SiluAndMul
from model_exec.layers.norm import GemmaRMSNorm, RMSNorm
from model_exec.layers.rotary import RopeAngles, RotaryEmbedding
from ops import fused_cuda
from ops.attention import cpu_kernels

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _close(got: torch.Tensor, want: torch.Tensor, exact: bool = False) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if got.dtype == torch.bfloat16:
        # The interpreter converts float32 to bfloat16 by truncation (numpy has no bfloat16; checked: 1 + 0.75
        # ulp becomes 1, where the GPU and torch round to 1 + ulp), so every rounding the kernels copy from
        # torch may land one unit lower here: allowed a unit or two at the tensor's scale, nothing more.
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), atol=scale * 2**-6, rtol=2**-6)
        return
    if exact:
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    elif got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # one row's sum of squares in another order: at most a unit in the last place
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def check_norm(dtype: torch.dtype, gemma: bool, residual: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = 200  # not a power of two: the masked tail
    norm = (GemmaRMSNorm if gemma else RMSNorm)(hidden, 1e-6, params_dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen).to(dtype))
        if gemma:
            norm.scale.copy_(1.0 + norm.weight.float())
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    r = torch.randn(7, hidden, generator=gen).to(dtype) if residual else None
    want = norm.forward_torch(x.clone(), None if r is None else r.clone())
    got = norm(x.clone(), None if r is None else r.clone())
    if r is None:
        _close(got, want)  # type: ignore[arg-type]
    else:
        _close(got[0], want[0])
        _close(got[1], want[1], exact=True)  # the residual sum: one rounding, the same


def check_rotary(dtype: torch.dtype, partial: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    head_dim, q_heads, kv_heads, tokens = 32, 4, 2, 9
    rope = RotaryEmbedding(head_dim, 64, 10000.0, rotary_dim=16 if partial else None)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    angles: RopeAngles = rope.angles(positions, dtype)
    # the q|k part of a fused qkv projection: a strided view, as the attention layers pass it
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    want = RotaryEmbedding.rotate(angles, qk.clone())
    got = RotaryEmbedding.rotate_owned(angles, qk)
    assert got.data_ptr() == qk.data_ptr(), "rotated in place"
    _close(got, want, exact=True)
    v = qkv[:, (q_heads + kv_heads) * head_dim :]
    assert torch.equal(v, qkv[:, (q_heads + kv_heads) * head_dim :]), "v untouched"


def check_silu(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for d in (100, 1536):  # a masked tail; several column blocks
        x = (3 * torch.randn(5, 2 * d, generator=gen)).to(dtype)
        want = SiluAndMul.forward_torch(x)
        got = SiluAndMul()(x)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        else:  # exp's last bit may move a rounding: one unit in the last place at most
            _close(got, want)


def check_model(kind: str) -> None:
    """Prefill logits of the tiny model with the kernels in every layer against plain torch (float32)."""
    import tempfile

    from model_exec.models import build_model, pack_weights
    from model_exec.parallel import TPGroup
    from model_exec.source import read_model_config, resolve_model
    from model_exec.weights import iter_weights
    from ops.attention.torch_backend import TorchAttentionBackend
    from tests.helpers.tiny_models import make_tiny_llama, make_tiny_qwen2, our_prefill_logits

    maker = {"llama": make_tiny_llama, "qwen2": make_tiny_qwen2}[kind]
    prompts = [[5, 17, 33, 2, 101, 250, 7, 9, 11], [3 + (7 * i) % 250 for i in range(23)]]
    with tempfile.TemporaryDirectory() as tmp:
        src = resolve_model(maker(tmp))
        config = read_model_config(src)
        net = build_model(config, TPGroup.single(), TorchAttentionBackend, "cpu", torch.float32)
        net.load_weights(iter_weights(src))
        pack_weights(net)
        fused_cuda._on_cpu = False
        want = our_prefill_logits(net, config, prompts, block_size=16, first_chunk=4)
        fused_cuda._on_cpu = True
        kernels = fused_cuda.kernels()
        calls: dict[str, int] = {}
        names = ("rms_norm", "add_rms_norm", "rotate_half_", "silu_and_mul")
        originals = {name: getattr(kernels, name) for name in names}
        for name, original in originals.items():

            def counted(*args: object, _f: Callable[..., object] = original, _n: str = name) -> object:
                calls[_n] = calls.get(_n, 0) + 1
                return _f(*args)

            setattr(kernels, name, counted)
        try:
            got = our_prefill_logits(net, config, prompts, block_size=16, first_chunk=4)
        finally:
            for name, original in originals.items():
                setattr(kernels, name, original)
        assert set(calls) == set(names), f"every kernel ran in the model: {calls}"
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def cases() -> dict[str, Callable[[], None]]:
    out: dict[str, Callable[[], None]] = {}
    for name, dtype in DTYPES.items():
        for gemma in (False, True):
            for residual in (False, True):
                out[f"norm-{'gemma' if gemma else 'llama'}-{'add' if residual else 'plain'}-{name}"] = (
                    lambda d=dtype, g=gemma, r=residual: check_norm(d, g, r)
                )
        for partial in (False, True):
            out[f"rotary-{'partial' if partial else 'full'}-{name}"] = lambda d=dtype, p=partial: check_rotary(d, p)
        out[f"silu-and-mul-{name}"] = lambda d=dtype: check_silu(d)
    out["model-llama"] = lambda: check_model("llama")
    out["model-qwen2"] = lambda: check_model("qwen2")
    return out


CASES = list(cases())


def main(selected: list[str]) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (set before triton loads)"
    cpu_kernels.load_error = lambda: "not used by the interpreter check"  # type: ignore[assignment]
    fused_cuda.interpret_on_cpu()
    results: dict[str, str | None] = {}
    for case_id, run in cases().items():
        if selected and case_id not in selected:
            continue
        try:
            with torch.inference_mode():
                run()
            results[case_id] = None
        except Exception:
            results[case_id] = traceback.format_exc(limit=-3)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
