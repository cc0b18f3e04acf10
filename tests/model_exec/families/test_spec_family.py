"""A new family from a spec alone: one registry row (model_exec/architectures.py), no model file.

Two Hugging Face architectures raytp has no row for, each a new combination of quirks the decoder already
implements, are added here the way a contributor would add them (the row, nothing else) and must equal HF:
- VaultGemma (VaultGemmaForCausalLM): Gemma's (1 + w) RMSNorm, embedding scale, query_pre_attn_scalar,
  attention and final logit soft-caps, alternating sliding/global layers, but Llama's two norms per layer
  (no sandwich norms), its MLP-input norm named `pre_feedforward_layernorm` in the checkpoint (a rename);
- Gemma 1 (GemmaForCausalLM): Gemma's norm, embedding scale and gelu-tanh MLP on Llama's layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import model_exec.models
from model_exec.architectures import ARCHITECTURES, Architecture, DecoderSpec
from model_exec.models.decoder import CausalDecoder
from tests.helpers.family_parity import assert_engine_matches_hf, assert_prefill_matches_hf, hf_model
from tests.helpers.tiny_models import BOS_ID, EOS_ID, make_tiny_model

NEW_ROWS = {
    "VaultGemmaForCausalLM": Architecture(
        "vaultgemma",
        decoder=DecoderSpec(
            gemma_norm=True,
            embed_scale=True,
            attn_scale_key="query_pre_attn_scalar",
            attn_soft_cap_key="attn_logit_softcapping",
            final_soft_cap_key="final_logit_softcapping",
            checkpoint_renames=((".pre_feedforward_layernorm.", ".post_attention_layernorm."),),
        ),
    ),
    "GemmaForCausalLM": Architecture("gemma", decoder=DecoderSpec(gemma_norm=True, embed_scale=True)),
}

SHAPE: dict[str, Any] = dict(
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
)


@pytest.fixture(scope="module")
def new_rows() -> Iterator[None]:
    """The registry with the new rows, for this module only."""
    assert not set(NEW_ROWS) & set(ARCHITECTURES), "the families must be new to raytp"
    with pytest.MonkeyPatch.context() as mp:
        for name, row in NEW_ROWS.items():
            mp.setitem(ARCHITECTURES, name, row)  # type: ignore[index]  # the registry is a dict
        yield


@pytest.fixture(scope="module")
def vaultgemma_dir(tmp_path_factory: pytest.TempPathFactory, new_rows: None) -> str:
    from transformers import VaultGemmaConfig

    config = VaultGemmaConfig(
        **SHAPE,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
    )
    return make_tiny_model(tmp_path_factory.mktemp("vaultgemma") / "tiny-vaultgemma", config)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, new_rows: None) -> str:
    from transformers import GemmaConfig

    # smaller weights than the others': with neither soft-cap nor window, the embedding scale (x8) at 0.3
    # makes attention so peaked that float32 rounding moves 45-token logits by ~7e-4 (against HF's sdpa and
    # eager alike, the shorter prompts within 7e-5); at 0.1 every prompt is within 3e-5 of either
    config = GemmaConfig(**{**SHAPE, "initializer_range": 0.1})
    return make_tiny_model(tmp_path_factory.mktemp("gemma") / "tiny-gemma", config)


def test_a_new_family_is_one_registry_row(vaultgemma_dir: str, gemma_dir: str) -> None:
    """The rows build the one decoder; no model file names either family."""
    assert all(model_exec.models.get_model_class(name) is CausalDecoder for name in NEW_ROWS)
    models_dir = Path(model_exec.models.__file__).parent
    sources = " ".join(p.read_text() for p in models_dir.glob("*.py"))
    assert "VaultGemma" not in sources and "GemmaForCausalLM" not in sources


def test_vaultgemma_prefill_matches_hf_at_tp_1_2(vaultgemma_dir: str) -> None:
    assert hf_model(vaultgemma_dir).config._attn_implementation == "eager"  # the soft-capping reference
    assert_prefill_matches_hf(vaultgemma_dir, (1, 2))


def test_vaultgemma_engine_matches_hf(vaultgemma_dir: str) -> None:
    assert_engine_matches_hf(vaultgemma_dir)


def test_gemma_prefill_matches_hf_at_tp_1_2(gemma_dir: str) -> None:
    assert_prefill_matches_hf(gemma_dir, (1, 2))
