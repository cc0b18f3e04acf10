"""Qwen3-MoE (top-2 of 6 experts renormalised by norm_topk_prob; per-head q/k RMSNorm; every second layer
sparse by decoder_sparse_step; GQA, head_dim * heads != hidden) equals HF: prefill at TP 1/2, the engine at
TP 1 and over Ray at TP 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.family_parity import (
    assert_engine_matches_hf,
    assert_gloo_tp_matches_hf,
    assert_prefill_matches_hf,
)
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=64,
        head_dim=32,
        intermediate_size=96,  # the dense layers' MLP
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=2,  # layers 1 and 3 sparse, 0 and 2 dense
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_moe") / "tiny-qwen3-moe", config)


def test_prefill_matches_hf(model_dir: str) -> None:
    assert_prefill_matches_hf(model_dir, (1, 2))


def test_engine_matches_hf(model_dir: str) -> None:
    assert_engine_matches_hf(model_dir)


@pytest.mark.usefixtures("ray_session")
def test_engine_tp2_over_ray_matches_hf(model_dir: str) -> None:
    assert_engine_matches_hf(model_dir, tensor_parallel_size=2)


@pytest.mark.parametrize("world_size", (2,))
def test_tp_over_gloo_processes_matches_hf(model_dir: str, world_size: int, tmp_path: Path) -> None:
    assert_gloo_tp_matches_hf(model_dir, world_size, tmp_path)
