"""Gemma 3 text (model_exec/models/gemma3.py) against Hugging Face on a tiny random model with its quirks on:
4 layers alternating sliding (window 8, shorter than the prompts) and global, GQA (8 q / 4 kv heads),
per-head q/k norms, per-layer-type rope (local theta 10k, global theta 1M with linear scaling x2), final
soft-cap 30, query_pre_attn_scalar != head_dim, tied embeddings. HF picks sdpa for Gemma 3 (nothing to
soft-cap in its attention), exact enough in float32 for the harness's tolerances."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from model_exec.architectures import ARCHITECTURES
from model_exec.config import ModelConfig
from model_exec.models.options import DecoderOptions, rope_by_layer_type
from model_exec.source import read_model_config, resolve_model
from tests.helpers.family_parity import (
    assert_engine_matches_hf,
    assert_gloo_tp_matches_hf,
    assert_prefill_matches_hf,
)
from tests.helpers.tiny_models import BOS_ID, EOS_ID, make_tiny_model

TINY_GEMMA3 = dict(
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
    final_logit_softcapping=30.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    },
)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import Gemma3TextConfig

    return make_tiny_model(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3", Gemma3TextConfig(**TINY_GEMMA3))


def test_prefill_matches_hf_at_tp_1_2_4(gemma3_dir: str) -> None:
    assert_prefill_matches_hf(gemma3_dir, (1, 2, 4))


def test_tp2_over_gloo_matches_hf(gemma3_dir: str, tmp_path: Path) -> None:
    assert_gloo_tp_matches_hf(gemma3_dir, 2, tmp_path)


def test_engine_matches_hf(gemma3_dir: str) -> None:
    assert_engine_matches_hf(gemma3_dir)


def test_engine_over_ray_at_tp2_matches_hf(gemma3_dir: str) -> None:
    assert_engine_matches_hf(gemma3_dir, tensor_parallel_size=2)


def _rope(config: ModelConfig) -> dict[str, tuple[float, object]]:
    return {t: (c.rope_theta, c.rope_scaling) for t, c in rope_by_layer_type(config, "rope_local_base_freq").items()}


def test_transformers4_config_json_reads_as_hf_defaults_it(gemma3_dir: str, tmp_path: Path) -> None:
    """Google's config.json form (rope_theta, rope_local_base_freq and rope_scaling instead of
    rope_parameters; sliding_window_pattern instead of layer_types; no tie_word_embeddings) reads as the
    same model, and one that omits them gets HF's Gemma3TextConfig defaults (5 local : 1 global layers,
    thetas 1M / 10k)."""
    new = read_model_config(resolve_model(gemma3_dir))
    raw = dict(json.loads(Path(gemma3_dir, "config.json").read_text()))
    for key in ("layer_types", "tie_word_embeddings", "rope_parameters", "_sliding_window_pattern"):
        raw.pop(key, None)
    old = {
        **raw,
        "sliding_window_pattern": 2,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    (tmp_path / "model.safetensors").write_bytes(b"")  # resolve_model wants a safetensors file to call it a model
    old_config = read_model_config(resolve_model(str(tmp_path)))
    assert old_config == new and _rope(old_config) == _rope(new)
    assert _rope(new) == {
        "full_attention": (1e6, {"rope_type": "linear", "factor": 2.0}),
        "sliding_attention": (1e4, None),
    }
    bare = {k: v for k, v in old.items() if k not in ("sliding_window_pattern", "rope_theta", "rope_local_base_freq")}
    path.write_text(json.dumps({**bare, "num_hidden_layers": 12, "rope_scaling": None}))
    defaults = read_model_config(resolve_model(str(tmp_path)))
    assert defaults.layer_windows == ((8,) * 5 + (None,)) * 2
    assert _rope(defaults) == {"full_attention": (1e6, None), "sliding_attention": (1e4, None)}


def test_attention_soft_cap_is_refused(gemma3_dir: str) -> None:
    """HF's Gemma 3 never applies attn_logit_softcapping; a config setting it is not served as if it did."""
    config = read_model_config(resolve_model(gemma3_dir))
    spec = ARCHITECTURES["Gemma3ForCausalLM"].decoder
    assert DecoderOptions.parse(config, spec).attn_soft_cap is None
    capped = replace(config, hf={**config.hf, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        DecoderOptions.parse(capped, spec)
