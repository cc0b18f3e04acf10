"""Qwen2-MoE (top-2 of 4 experts, not renormalised; a sigmoid-gated shared expert; q/k/v biases; a dense
layer from mlp_only_layers; GQA, tied embeddings) equals HF: prefill at TP 1/2/4, the engine at TP 1 and
over Ray at TP 2."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from model_exec.config import ModelConfig
from tests.helpers.family_parity import (
    assert_engine_matches_hf,
    assert_gloo_tp_matches_hf,
    assert_prefill_matches_hf,
)
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,  # the dense layer's MLP
        moe_intermediate_size=48,  # per rank 48 / 24 / 12: the panel kernel's fused and unfused gate/up paths
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    return make_tiny_model(tmp_path_factory.mktemp("qwen2_moe") / "tiny-qwen2-moe", config)


def test_prefill_matches_hf(model_dir: str) -> None:
    assert_prefill_matches_hf(model_dir, (1, 2, 4))


def test_qkv_bias_defaults_on(model_dir: str) -> None:
    """Published Qwen1.5-MoE configs do not write `qkv_bias`; HF's default (on) applies."""
    raw = json.loads(Path(model_dir, "config.json").read_text())
    assert raw.pop("qkv_bias") is True
    config = ModelConfig.from_hf_config(SimpleNamespace(**raw))
    assert config.qkv_bias and not config.o_bias
    assert not ModelConfig.from_hf_config(SimpleNamespace(**raw, qkv_bias=False)).qkv_bias


def test_engine_matches_hf(model_dir: str) -> None:
    assert_engine_matches_hf(model_dir)


@pytest.mark.usefixtures("ray_session")
def test_engine_tp2_over_ray_matches_hf(model_dir: str) -> None:
    assert_engine_matches_hf(model_dir, tensor_parallel_size=2)


@pytest.mark.parametrize("world_size", (2,))
def test_tp_over_gloo_processes_matches_hf(model_dir: str, world_size: int, tmp_path: Path) -> None:
    assert_gloo_tp_matches_hf(model_dir, world_size, tmp_path)
