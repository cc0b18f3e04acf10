"""Qwen3 against Hugging Face: per-head q/k RMSNorm, head_dim apart from hidden / heads, attention_bias,
untied head; GQA 8 q / 4 KV heads so TP 1, 2 and 4 split them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.family_parity import (
    assert_engine_matches_hf,
    assert_gloo_tp_matches_hf,
    assert_prefill_matches_hf,
)
from tests.helpers.tiny_models import BOS_ID, EOS_ID, make_tiny_model


def qwen3_config(**overrides: object) -> object:
    from transformers import Qwen3Config

    fields: dict[str, object] = dict(
        vocab_size=320,
        hidden_size=64,
        head_dim=16,  # 8 heads x 16 = 128 != hidden_size
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=True,
        tie_word_embeddings=False,
        initializer_range=0.3,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    return Qwen3Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", qwen3_config())


def test_qwen3_loads_its_q_k_norms(qwen3: str) -> None:
    from tests.helpers.tiny_models import load_our_model

    net, config = load_our_model(qwen3)
    names = dict(net.named_parameters())
    assert config.architecture == "Qwen3ForCausalLM" and config.qkv_bias and config.o_bias
    assert names["model.layers.2.self_attn.q_norm.weight"].shape == (16,)
    assert not (names["model.layers.2.self_attn.k_norm.weight"] == 1).all()  # loaded, not the init


def test_qwen3_prefill_matches_hf(qwen3: str) -> None:
    assert_prefill_matches_hf(qwen3, (1, 2, 4))


def test_qwen3_engine_matches_hf(qwen3: str) -> None:
    assert_engine_matches_hf(qwen3)


def test_qwen3_engine_over_ray_tp2_matches_hf(qwen3: str) -> None:
    assert_engine_matches_hf(qwen3, tensor_parallel_size=2)


def test_qwen3_registry_row() -> None:
    from model_exec.architectures import ARCHITECTURES
    from model_exec.models import get_model_class
    from model_exec.models.decoder import CausalDecoder

    row = ARCHITECTURES["Qwen3ForCausalLM"]
    assert row.model_type == "qwen3" and row.decoder.qk_norm
    assert get_model_class("Qwen3ForCausalLM") is CausalDecoder


@pytest.mark.parametrize("world_size", (2, 4))
def test_tp_over_gloo_processes_matches_hf(qwen3: str, world_size: int, tmp_path: Path) -> None:
    assert_gloo_tp_matches_hf(qwen3, world_size, tmp_path)
