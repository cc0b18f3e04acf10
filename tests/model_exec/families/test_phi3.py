"""Phi-3 / Phi-4 against Hugging Face: fused qkv_proj and gate_up_proj in the checkpoint (each TP rank
cuts its slices), partial rotary (0.75, as Phi-4-mini), longrope, and one sliding window (8) shorter than
the prompts; GQA 8 q / 4 KV heads so TP 1, 2 and 4 split them.

Two checkpoints of the same shape. `phi3_long` puts original_max_position_embeddings (10) between the
prompts' lengths, so prefill uses the short factors for some prompts and the long ones for others, as
HF does per forward; chunked prefill there starts with an 11-token chunk, already past it. The engine
runs `phi3` (original 160, above every sequence the engine test makes) because HF's Phi-3 drops its KV
cache and re-prefills with the long factors when a generation crosses the threshold, which raytp does
not do (model_exec/layers/rotary.py): there both keep the short factors, with longrope's attention
factor (max_position_embeddings / original = 1.6) on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.family_parity import (
    assert_engine_matches_hf,
    assert_gloo_tp_matches_hf,
    assert_prefill_matches_hf,
)
from tests.helpers.tiny_models import BOS_ID, EOS_ID, make_tiny_model

HEAD_DIM, PARTIAL = 16, 0.75  # 12 rotated features per head: 6 frequencies
LONG_ORIGINAL = 10
FIRST_CHUNK = LONG_ORIGINAL + 1
# HF's own fp32 logits on this model are 7e-4 from its fp64 ones (hidden 128, three peaky layers), ours as
# far: 1e-4, the harness' default, is below that noise
ATOL = 1e-3


def phi3_config(original_max_position_embeddings: int) -> object:
    from transformers import Phi3Config

    gen = torch.Generator().manual_seed(3)
    n = int(HEAD_DIM * PARTIAL) // 2
    return Phi3Config(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=original_max_position_embeddings,
        partial_rotary_factor=PARTIAL,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": (1.0 + torch.rand(n, generator=gen)).tolist(),
            "long_factor": (2.0 + 4.0 * torch.rand(n, generator=gen)).tolist(),
        },
        sliding_window=8,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.3,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("phi3") / "tiny-phi3", phi3_config(160))


@pytest.fixture(scope="module")
def phi3_long(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("phi3") / "tiny-phi3-long", phi3_config(LONG_ORIGINAL))


def test_phi3_checkpoint_is_fused_and_config_parsed(phi3_long: str) -> None:
    from safetensors import safe_open

    from model_exec.source import read_model_config, resolve_model

    with safe_open(str(Path(phi3_long) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    config = read_model_config(resolve_model(phi3_long))
    assert config.architecture == "Phi3ForCausalLM" and config.rotary_dim == 12
    assert config.rope_type == "longrope" and config.rope_scaling is not None
    assert config.rope_scaling["original_max_position_embeddings"] == LONG_ORIGINAL
    assert config.layer_windows == (8, 8, 8)


def test_phi3_prefill_matches_hf(phi3_long: str) -> None:
    assert_prefill_matches_hf(phi3_long, (1, 2, 4), ATOL, first_chunk=FIRST_CHUNK)


def test_phi3_gloo_tp2_matches_hf(phi3_long: str, tmp_path: Path) -> None:
    assert_gloo_tp_matches_hf(phi3_long, 2, tmp_path, ATOL)


def test_phi3_engine_matches_hf(phi3: str) -> None:
    assert_engine_matches_hf(phi3)


def test_phi3_engine_over_ray_tp2_matches_hf(phi3: str) -> None:
    assert_engine_matches_hf(phi3, tensor_parallel_size=2)


def test_fused_checkpoint_tensor_of_the_wrong_size_is_refused(phi3: str) -> None:
    from tests.helpers.tiny_models import load_our_model

    net, _ = load_our_model(phi3)
    qkv = dict(net.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
    wrong = torch.zeros(qkv.shape[0] - HEAD_DIM, 128)
    with pytest.raises(ValueError, match="fused checkpoint tensor has"):
        net.load_weights([("model.layers.0.self_attn.qkv_proj.weight", wrong)])
