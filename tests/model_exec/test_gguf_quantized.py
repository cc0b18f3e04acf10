"""A GGUF model kept in its blocks (issue 39): tiny Llama files written by the `gguf` package's quantizer.

- every linear layer and the (tied) embedding/LM head keep their blocks, and the model's prefill logits
  follow the same weights dequantized to float32 (the reference path) within the int8 activations' rounding;
- tensor parallelism (simulated ranks, TP 2) gives the TP 1 logits up to the all-reduce's float order:
  row-parallel cuts fall on block boundaries, so every rank multiplies its own blocks;
- a layer fed a type without a kernel (Q5_0 here) runs dequantized, its blocks-kept siblings do not;
- `quantization=` is honoured or refused by name.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from model_exec.layers.linear import LinearBase  # noqa: E402
from model_exec.layers.quantization import scope  # noqa: E402
from model_exec.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod, kernels_available  # noqa: E402
from model_exec.layers.quantization.select import select_quantization  # noqa: E402
from model_exec.models import build_model, pack_weights  # noqa: E402
from model_exec.parallel import TPGroup  # noqa: E402
from model_exec.source import read_model_config, resolve_model  # noqa: E402
from model_exec.weights import iter_weights  # noqa: E402
from ops.attention import get_attn_backend  # noqa: E402
from tests.helpers.family_parity import PREFILL_PROMPTS  # noqa: E402
from tests.helpers.tiny_gguf import write_tiny_gguf  # noqa: E402
from tests.helpers.tiny_models import make_tiny_llama, our_prefill_logits, run_in_rank_threads  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C++ kernels' AVX2 build is not available")

T = gguf.GGMLQuantizationType
MIXED = {"token_embd": T.Q8_0, "ffn": T.Q4_0, "attn": T.Q4_1}


def _gguf(tmp: Path, types: dict[str, object]) -> str:
    return write_tiny_gguf(make_tiny_llama(tmp), tmp / "gguf", quant_types=types)


def _load(path: str, keep: bool, tp: TPGroup | None = None) -> tuple[torch.nn.Module, object]:
    src = resolve_model(path)
    config = read_model_config(src)
    with scope(GGUFConfig() if keep else None):
        net = build_model(config, tp or TPGroup.single(), get_attn_backend("torch", "cpu"), "cpu", torch.float32)
    net.load_weights(iter_weights(src, keep_gguf_blocks=keep))  # type: ignore[operator]
    pack_weights(net)  # type: ignore[arg-type]
    return net, config


def _gguf_methods(net: torch.nn.Module) -> list[GGUFLinearMethod]:
    return [m.quant_method for m in net.modules() if isinstance(m, LinearBase)]  # type: ignore[misc]


def test_blocks_are_kept_and_follow_the_dequantized_reference(tmp_path: Path) -> None:
    path = _gguf(tmp_path, MIXED)
    kept, config = _load(path, keep=True)
    methods = _gguf_methods(kept)
    assert methods and all(isinstance(m, GGUFLinearMethod) and m.segments and m.dense is None for m in methods)
    assert {qtype for m in methods for qtype, _ in m.segments} == {int(T.Q4_0), int(T.Q4_1)}
    embed = kept.model.embed_tokens  # type: ignore[union-attr]
    assert embed.gguf_weight is not None and embed.gguf_weight[0] == int(T.Q8_0)
    assert embed.weight.stride() == (0, 0)  # no float copy kept
    assert kept.lm_head.gguf_weight is embed.gguf_weight  # type: ignore[union-attr]  # tied: the same blocks
    reference, _ = _load(path, keep=False)
    ours = our_prefill_logits(kept, config, PREFILL_PROMPTS)
    ref = our_prefill_logits(reference, config, PREFILL_PROMPTS)
    assert ours is not None and ref is not None
    for a, b in zip(ours, ref, strict=True):
        # the tiny model's random weights (init 0.3) amplify each layer's int8 rounding; a wrong block layout,
        # row order or scale gives uncorrelated logits (cosine ~0), this gives > 0.99
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert float(cos.min()) > 0.98, cos


def test_q8_0_everywhere_is_close(tmp_path: Path) -> None:
    path = _gguf(tmp_path, {"": T.Q8_0})
    kept, config = _load(path, keep=True)
    reference, _ = _load(path, keep=False)
    ours = our_prefill_logits(kept, config, PREFILL_PROMPTS)
    ref = our_prefill_logits(reference, config, PREFILL_PROMPTS)
    assert ours is not None and ref is not None
    for a, b in zip(ours, ref, strict=True):
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.99


def test_tensor_parallel_equals_tp1(tmp_path: Path) -> None:
    path = _gguf(tmp_path, MIXED)
    single, config = _load(path, keep=True)
    expected = our_prefill_logits(single, config, PREFILL_PROMPTS)

    def rank(tp: TPGroup) -> list[torch.Tensor] | None:
        net, cfg = _load(path, keep=True, tp=tp)
        assert all(m.segments for m in _gguf_methods(net))
        return our_prefill_logits(net, cfg, PREFILL_PROMPTS, tp=tp)

    got = run_in_rank_threads(2, rank)[0]
    assert got is not None and expected is not None
    for a, b in zip(got, expected, strict=True):
        # every rank multiplies the same blocks with the same int8 activations; only the all-reduce's float
        # order differs, and where that moves an activation across an int8 rounding boundary the tiny random
        # model amplifies the one-step change: close, not equal (the float path is continuous there, this is not)
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.999
        assert float((a - b).abs().max()) < 0.03 * float(b.abs().max())


def test_a_type_without_kernel_runs_dequantized(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _gguf(tmp_path, {"attn_v": T.Q5_0, "attn": T.Q4_1, "ffn": T.Q8_0})
    with caplog.at_level(logging.INFO, logger="model_exec.weights"):
        kept, config = _load(path, keep=True)
    layer0 = kept.model.layers[0]  # type: ignore[union-attr]
    qkv = layer0.self_attn.qkv_proj.quant_method
    assert qkv.dense is not None and not qkv.segments  # v came as floats: the layer runs as floats
    assert layer0.self_attn.o_proj.quant_method.segments  # its sibling keeps its blocks
    assert layer0.mlp.gate_up_proj.quant_method.segments
    assert any("Q5_0 x" in r.getMessage() for r in caplog.records)
    reference, _ = _load(path, keep=False)
    ours, ref = (our_prefill_logits(n, config, PREFILL_PROMPTS) for n in (kept, reference))
    assert ours is not None and ref is not None
    assert all(
        float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.98 for a, b in zip(ours, ref, strict=True)
    )


def test_quantization_setting() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    assert isinstance(select_quantization("gguf", "gguf", cpu, f32), GGUFConfig)
    assert isinstance(select_quantization(None, "gguf", cpu, f32), GGUFConfig)  # the default: blocks kept
    assert select_quantization(None, "gguf", cpu, torch.bfloat16) is None  # unasked: dequantized where they cannot run
    assert select_quantization("none", "gguf", cpu, f32) is None
    assert select_quantization(None, "safetensors", cpu, f32) is None
    with pytest.raises(ValueError, match="gguf"):
        select_quantization("gguf", "gguf", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="GGUF checkpoint"):
        select_quantization("gguf", "safetensors", cpu, f32)
    with pytest.raises(ValueError, match="not supported"):
        select_quantization("awq", "gguf", cpu, f32)
