"""The one-call decode layer (ops/csrc/decode_layer.cpp, model_exec/models/fused_decode.py) against the
unfused layers it replaces.

It composes the same kernels in the same order, so a decode step's hidden states, logits and KV caches are
bit-identical to the Python path's: checked over several decode steps of several rows with different
context lengths (one crossing a block boundary), GQA, for fp32 panels (odd shapes: head_dim 16 with
biases and llama3 rope scaling; an intermediate size the fused SiLU panel kernel cannot take), GGUF blocks
(Q4_1, and a Q4_K_M-style mix of types inside one layer) and int8. Layers it does not cover keep the Python
path by an explicit check (the torch attention backend, oneDNN weights, LoRA, q/k norms).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from model_exec.layers.quantization import scope
from model_exec.layers.quantization.base import QuantizationConfig
from model_exec.layers.quantization.gguf import GGUFConfig, kernels_available
from model_exec.layers.quantization.int8 import Int8Config
from model_exec.models import build_model, decoder, pack_weights
from model_exec.parallel import TPGroup
from model_exec.source import read_model_config, resolve_model
from model_exec.weights import iter_weights
from ops import fused_decode
from ops.attention import get_attn_backend
from tests.helpers.tiny_models import (
    make_kv_caches,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_untied_rope_scaled,
    prefill_inputs,
)

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C++ kernels' AVX2 build is not available")

BLOCK = 4
PROMPT_LENS = [5, 8, 3]  # rows of different contexts; row 1 starts a new block at its first decode
DECODE_STEPS = 4


def _load(path: str, quant: QuantizationConfig | None, backend: str = "cpu", panels: bool = True) -> Any:
    src = resolve_model(path)
    config = read_model_config(src)
    with scope(quant):
        net = build_model(config, TPGroup.single(), get_attn_backend(backend, "cpu"), "cpu", torch.float32)
    keep = quant is not None and quant.keeps_gguf_blocks()
    net.load_weights(iter_weights(src, keep_gguf_blocks=keep))
    pack_weights(net, panels=panels)
    return net, config


@torch.inference_mode()
def _decode_run(net: Any, config: Any, fused: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill each row's prompt, then DECODE_STEPS all-decode steps (teacher-forced tokens); returns the
    decode steps' final hidden states and the layers' caches."""
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, config.vocab_size, (n + DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]
    ids, pos, meta, num_blocks = prefill_inputs(seqs, BLOCK, end=PROMPT_LENS)
    caches = make_kv_caches(config, 1, num_blocks, BLOCK, torch.float32, "cpu")
    net.model._fused = None if fused else False  # decided afresh (below), or the Python path
    net(ids, pos, caches, meta)
    outs = []
    for step in range(DECODE_STEPS):
        start = [n + step for n in PROMPT_LENS]
        ids, pos, meta, _ = prefill_inputs(seqs, BLOCK, start=start, end=[s + 1 for s in start])
        meta = dataclasses.replace(meta, num_decodes=len(seqs))
        outs.append(net(ids, pos, caches, meta).clone())
    return outs, [t for pair in caches for t in pair]


def _assert_same(net: Any, config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert net.model.fused_decode_plans() is not None, "the fused path should cover this model"
    calls = []

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return fused_decode.decode_layer(*args)

    monkeypatch.setattr(decoder, "decode_layer", counted)
    fused_out, fused_kv = _decode_run(net, config, fused=True)
    assert len(calls) == DECODE_STEPS * config.num_hidden_layers  # one call per layer and decode step, no prefill
    ref_out, ref_kv = _decode_run(net, config, fused=False)
    for a, b in zip(fused_out, ref_out, strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())
    for a, b in zip(fused_kv, ref_kv, strict=True):
        assert torch.equal(a, b)
    logits_a, logits_b = net.compute_logits(fused_out[-1]), net.compute_logits(ref_out[-1])
    assert torch.equal(logits_a.argmax(-1), logits_b.argmax(-1))


def test_fp32_panels_gqa(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_same(*_load(make_tiny_llama(tmp_path), None), monkeypatch)


def test_fp32_odd_shapes_biases_rope_scaling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # head_dim 16 != hidden / heads, q/k/v/o and MLP biases, llama3 rope scaling, untied head
    _assert_same(*_load(make_tiny_untied_rope_scaled(tmp_path), None), monkeypatch)


def test_fp32_gate_up_without_the_fused_silu_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # half = 40 is no multiple of the 16-wide panels: gate|up, then the separate SiLU-and-mul kernel
    net, config = _load(make_tiny_qwen2(tmp_path, intermediate_size=40), None)
    plans = net.model.fused_decode_plans()
    assert plans is not None and plans[0].plan[5] == 0  # fused_silu off
    _assert_same(net, config, monkeypatch)


@pytest.mark.parametrize("types", ["q4_1", "mixed"])
def test_gguf_blocks(tmp_path: Path, types: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = pytest.importorskip("gguf")
    from tests.helpers.tiny_gguf import write_tiny_gguf

    t = gguf.GGMLQuantizationType
    quant_types = {"": t.Q4_1} if types == "q4_1" else {"attn_v": t.Q8_0, "attn": t.Q4_1, "ffn": t.Q4_0}
    path = write_tiny_gguf(make_tiny_llama(tmp_path), tmp_path / "gguf", quant_types=quant_types)
    net, config = _load(path, GGUFConfig())
    qkv = net.model.layers[0].self_attn.qkv_proj.quant_method
    assert len(qkv.segments) == (1 if types == "q4_1" else 2)  # the mix: q|k Q4_1, v Q8_0
    _assert_same(net, config, monkeypatch)


def test_int8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_same(*_load(make_tiny_llama(tmp_path), Int8Config()), monkeypatch)


def test_what_it_does_not_cover_keeps_the_python_path(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path)
    torch_backend, _ = _load(path, None, backend="torch")
    assert torch_backend.model.fused_decode_plans() is None
    onednn, _ = _load(path, None, panels=False)
    assert onednn.model.fused_decode_plans() is None
    lora, _ = _load(path, None)
    lora.model.layers[1].mlp.down_proj.lora = object()  # any attached LoRA slots: their Python forward adds it
    assert lora.model.fused_decode_plans() is None


def test_unpacked_weights_are_decided_after_packing(tmp_path: Path) -> None:
    src = resolve_model(make_tiny_llama(tmp_path))
    config = read_model_config(src)
    net = build_model(config, TPGroup.single(), get_attn_backend("cpu", "cpu"), "cpu", torch.float32)
    net.load_weights(iter_weights(src))
    assert net.model.fused_decode_plans() is None and net.model._fused is None  # not yet decided
    pack_weights(net)
    assert net.model.fused_decode_plans() is not None


def test_disabled_by_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYTP_CPU_DECODE_LAYER", "0")
    net, _ = _load(make_tiny_llama(tmp_path), None)
    assert net.model.fused_decode_plans() is None
