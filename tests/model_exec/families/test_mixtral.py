"""Mixtral (sparse MoE, top-2 of 4 experts renormalised, GQA) equals HF: prefill at TP 1/2/4, gloo TP 2, the
engine at TP 1 and over Ray at TP 2; a checkpoint with transformers 5's stacked expert tensors loads the same."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_exec.models import build_model
from model_exec.parallel import TPGroup
from model_exec.source import read_model_config, resolve_model
from ops.attention import get_attn_backend
from tests.helpers.family_parity import (
    PREFILL_PROMPTS,
    assert_engine_matches_hf,
    assert_gloo_tp_matches_hf,
    assert_logits_match,
    assert_prefill_matches_hf,
    hf_model,
)
from tests.helpers.tiny_models import hf_prefill_logits, load_our_model, make_tiny_model, our_prefill_logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import MixtralConfig

    config = MixtralConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=64,  # per rank 64 / 32 / 16: the panel kernel's fused gate/up path at every TP size
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    return make_tiny_model(tmp_path_factory.mktemp("mixtral") / "tiny-mixtral", config)


def test_prefill_matches_hf(model_dir: str) -> None:
    assert_prefill_matches_hf(model_dir, (1, 2, 4))


def test_gloo_tp2_matches_hf(model_dir: str, tmp_path: Path) -> None:
    assert_gloo_tp_matches_hf(model_dir, 2, tmp_path)


def test_stacked_expert_checkpoint_loads(model_dir: str, tmp_path: Path) -> None:
    """transformers 5's in-memory names: `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
    [E, H, I], `mlp.gate` (what a checkpoint written from the state dict holds)."""
    tensors = load_file(str(Path(model_dir, "model.safetensors")))
    stacked = {}
    for layer in range(3):
        moe = f"model.layers.{layer}.block_sparse_moe"
        experts = [[tensors.pop(f"{moe}.experts.{e}.{w}.weight") for w in ("w1", "w3", "w2")] for e in range(4)]
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(x[:2]) for x in experts])
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([x[2] for x in experts])
        stacked[f"model.layers.{layer}.mlp.gate.weight"] = tensors.pop(f"{moe}.gate.weight")
    copy = tmp_path / "stacked"
    copy.mkdir()
    for f in Path(model_dir).iterdir():
        if f.name != "model.safetensors":
            (copy / f.name).write_bytes(f.read_bytes())
    save_file({**tensors, **stacked}, str(copy / "model.safetensors"))
    net, config = load_our_model(str(copy))
    ours = our_prefill_logits(net, config, PREFILL_PROMPTS)
    assert_logits_match(ours, hf_prefill_logits(hf_model(model_dir), PREFILL_PROMPTS))


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"num_experts_per_tok": None}, "num_experts_per_tok is required"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"),
        ({"num_local_experts": "4"}, "num_local_experts must be a positive integer"),
    ],
)
def test_bad_moe_fields_are_named(model_dir: str, change: dict[str, object], error: str) -> None:
    config = read_model_config(resolve_model(model_dir))
    config = replace(config, hf={**config.hf, **change})
    with pytest.raises(ValueError, match=error):
        build_model(config, TPGroup.single(), get_attn_backend("torch", "cpu"), "meta")


def test_engine_matches_hf(model_dir: str) -> None:
    assert_engine_matches_hf(model_dir)


@pytest.mark.usefixtures("ray_session")
def test_engine_tp2_over_ray_matches_hf(model_dir: str) -> None:
    assert_engine_matches_hf(model_dir, tensor_parallel_size=2)
