"""`quantization="int8"` (issue 39): weight-only int8 (Q8_0 blocks: an fp16 scale per 32 weights) computed at load.

- the blocks hold every weight to within half a quantization step of its float value;
- every linear layer and the LM head run the block kernel, and the tiny model's prefill logits follow the float
  model's; simulated TP 2 follows TP 1 (each rank quantizes its own rows / input-feature blocks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_exec.layers.linear import LinearBase
from model_exec.layers.quantization import scope
from model_exec.layers.quantization.gguf import kernels_available
from model_exec.layers.quantization.gguf_tensor import Q8_0, GGUFTensor
from model_exec.layers.quantization.int8 import Int8Config, Int8LinearMethod, quantize_q8_0
from model_exec.layers.quantization.select import select_quantization
from model_exec.models import build_model, pack_weights
from model_exec.parallel import TPGroup
from model_exec.source import read_model_config, resolve_model
from model_exec.weights import iter_weights
from ops.attention import get_attn_backend
from tests.helpers.family_parity import PREFILL_PROMPTS
from tests.helpers.tiny_models import make_tiny_llama, our_prefill_logits, run_in_rank_threads

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C++ kernels' AVX2 build is not available")


def test_q8_0_blocks_round_to_nearest_step() -> None:
    w = torch.randn(7, 96) * torch.logspace(-3, 1, 96)  # scales vary along the row: per-group scales matter
    w[2, :32] = 0.0  # an all-zero group: scale 0, values 0
    blocks = quantize_q8_0(w)
    back = GGUFTensor(blocks, Q8_0, 96).dequantize()
    step = blocks.view(7, 3, 34)[..., :2].contiguous().view(torch.float16).float().repeat_interleave(32, dim=1)
    step = step.view(7, 96)
    assert torch.all((back - w).abs() <= step / 2 * 1.001 + 1e-12)
    assert torch.equal(back[2, :32], torch.zeros(32))


def _load(path: str, quant: bool, tp: TPGroup | None = None) -> tuple[torch.nn.Module, object]:
    src = resolve_model(path)
    config = read_model_config(src)
    with scope(Int8Config() if quant else None):
        net = build_model(config, tp or TPGroup.single(), get_attn_backend("torch", "cpu"), "cpu", torch.float32)
    net.load_weights(iter_weights(src))  # type: ignore[operator]
    pack_weights(net)  # type: ignore[arg-type]
    return net, config


def test_int8_model_follows_the_float_model(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path)
    net, config = _load(path, quant=True)
    methods = [m.quant_method for m in net.modules() if isinstance(m, LinearBase)]
    assert methods and all(isinstance(m, Int8LinearMethod) and m.blocks is not None for m in methods)
    assert net.lm_head.gguf_weight is not None  # type: ignore[union-attr]
    reference, _ = _load(path, quant=False)
    ours = our_prefill_logits(net, config, PREFILL_PROMPTS)
    ref = our_prefill_logits(reference, config, PREFILL_PROMPTS)
    assert ours is not None and ref is not None
    for a, b in zip(ours, ref, strict=True):
        assert (
            float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.98
        )  # tiny random model, see test_gguf_quantized

    def rank(tp: TPGroup) -> list[torch.Tensor] | None:
        sharded, cfg = _load(path, quant=True, tp=tp)
        return our_prefill_logits(sharded, cfg, PREFILL_PROMPTS, tp=tp)

    got = run_in_rank_threads(2, rank)[0]
    assert got is not None
    for a, b in zip(got, ours, strict=True):
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.995


def test_int8_setting() -> None:
    assert isinstance(select_quantization("int8", "safetensors", torch.device("cpu"), torch.float32), Int8Config)
    with pytest.raises(ValueError, match="int8"):
        select_quantization("int8", "safetensors", torch.device("cpu"), torch.bfloat16)
