"""Gemma 2 (model_exec/models/gemma2.py) against Hugging Face on a tiny random model with every quirk on:
4 layers alternating sliding (window 8, shorter than the prompts) and global, GQA (8 q / 4 kv heads,
head_dim * heads != hidden), attention soft-cap 5 (it changes most greedy tokens of this model) and final
soft-cap 30 (it moves the logits by ~25), query_pre_attn_scalar != head_dim, tied embeddings.
HF runs Gemma 2 with eager attention (its sdpa path cannot soft-cap), the default it picks itself."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model_exec.architectures import ARCHITECTURES
from model_exec.config import HIDDEN_ACTS
from model_exec.layers.activation import ACT_AND_MUL, GeluAndMul, GeluTanhAndMul
from model_exec.layers.norm import GemmaRMSNorm
from model_exec.models import build_model
from model_exec.models.options import DecoderOptions
from model_exec.parallel import TPGroup
from model_exec.source import read_model_config, resolve_model
from ops.attention import get_attn_backend
from tests.helpers.family_parity import (
    assert_engine_matches_hf,
    assert_gloo_tp_matches_hf,
    assert_prefill_matches_hf,
    hf_model,
)
from tests.helpers.tiny_models import BOS_ID, EOS_ID, make_tiny_model

TINY_GEMMA2 = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=0,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=30.0,
)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import Gemma2Config

    return make_tiny_model(tmp_path_factory.mktemp("gemma2") / "tiny-gemma2", Gemma2Config(**TINY_GEMMA2))


def test_prefill_matches_hf_at_tp_1_2_4(gemma2_dir: str) -> None:
    assert hf_model(gemma2_dir).config._attn_implementation == "eager"  # the soft-capping reference
    assert_prefill_matches_hf(gemma2_dir, (1, 2, 4))


def test_engine_matches_hf(gemma2_dir: str) -> None:
    assert_engine_matches_hf(gemma2_dir)


def test_engine_over_ray_at_tp2_matches_hf(gemma2_dir: str) -> None:
    assert_engine_matches_hf(gemma2_dir, tensor_parallel_size=2)


def test_transformers4_config_json_reads_as_hf_defaults_it(gemma2_dir: str, tmp_path: Path) -> None:
    """A config.json as Google's checkpoints ship it (no layer_types, no tie_word_embeddings, rope_theta
    and hidden_act instead of rope_parameters) reads as the same model: HF's Gemma2Config defaults
    (model_exec/architectures.py) fill what it omits."""
    old = dict(json.loads(Path(gemma2_dir, "config.json").read_text()))
    for key in ("layer_types", "tie_word_embeddings", "rope_parameters", "use_bidirectional_attention", "dtype"):
        old.pop(key)
    old.update(rope_theta=10000.0, hidden_act="gelu_pytorch_tanh", torch_dtype="float32")
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    (old_dir / "config.json").write_text(json.dumps(old))
    (old_dir / "model.safetensors").write_bytes(b"")  # resolve_model wants one to call the dir a model
    new_config = read_model_config(resolve_model(gemma2_dir))
    old_config = read_model_config(resolve_model(str(old_dir)))
    assert old_config == new_config
    assert old_config.layer_windows == (8, None, 8, None) and old_config.tie_word_embeddings
    spec = ARCHITECTURES["Gemma2ForCausalLM"].decoder
    parsed = DecoderOptions.parse(old_config, spec)
    assert parsed == DecoderOptions.parse(new_config, spec) == DecoderOptions(spec, 24**-0.5, 5.0, 30.0)
    for bad in (
        {"query_pre_attn_scalar": None},
        {"final_logit_softcapping": -1.0},
        {"use_bidirectional_attention": True},
    ):
        (old_dir / "config.json").write_text(json.dumps({**old, **bad}))
        with pytest.raises(ValueError, match=next(iter(bad))):
            DecoderOptions.parse(read_model_config(resolve_model(str(old_dir))), spec)


def test_bfloat16_norms_and_embedding_scale_round_as_hf(gemma2_dir: str) -> None:
    """Off the float32 kernels: the norm multiplies by (1 + w) in float32 before casting (Llama's casts
    first), and sqrt(hidden) is rounded to the model dtype (sqrt(3072) = 55.43 -> 55.5 in bfloat16)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm, Gemma2TextScaledWordEmbedding

    bf16 = torch.bfloat16
    torch.manual_seed(0)
    weight = (0.3 * torch.randn(256)).to(bf16)
    ref = Gemma2RMSNorm(256, eps=1e-6).to(bf16)
    ref.weight.data.copy_(weight)
    ours = GemmaRMSNorm(256, 1e-6, bf16)
    ours.weight.weight_loader(ours.weight, weight)  # type: ignore[attr-defined]
    x, residual = (4 * torch.randn(5, 256)).to(bf16), torch.randn(5, 256).to(bf16)
    assert torch.equal(ours(x), ref(x))
    normed, stream = ours(x.clone(), residual.clone())
    assert torch.equal(stream, residual + x) and torch.equal(normed, ref(residual + x))

    config = read_model_config(resolve_model(gemma2_dir))
    config = replace(config, hidden_size=3072, num_hidden_layers=1, layer_windows=(8,))
    model = build_model(config, TPGroup.single(), get_attn_backend("torch", "cpu"), "cpu", bf16)
    hf_scale = Gemma2TextScaledWordEmbedding(4, 3072, 0, embed_scale=3072**0.5).embed_scale.to(bf16)
    assert model.model.embed_scale.dtype == bf16 and torch.equal(model.model.embed_scale, hf_scale)  # type: ignore[attr-defined]
    assert hf_scale.item() == 55.5


def test_gelu_tanh_gate_is_hfs() -> None:
    from transformers.activations import ACT2FN

    assert set(HIDDEN_ACTS) == set(ACT_AND_MUL)  # the torch-free config accepts what the layers implement
    x = 3 * torch.randn(7, 2 * 96)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(GeluTanhAndMul()(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)
    assert torch.equal(GeluAndMul()(x), ACT2FN["gelu"](gate) * up)


@pytest.mark.parametrize("world_size", (2,))
def test_tp_over_gloo_processes_matches_hf(gemma2_dir: str, world_size: int, tmp_path: Path) -> None:
    assert_gloo_tp_matches_hf(gemma2_dir, world_size, tmp_path)
