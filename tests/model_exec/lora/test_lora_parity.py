"""LoRA prefill logits against Hugging Face with the adapter merged into its weights (PEFT's merge_and_unload).

Llama (q, k, v, o, gate, up, down as separate HF modules: each stacked part of qkv_proj and gate_up_proj
gets its own A and B) and Phi-3 (qkv_proj and gate_up_proj fused in HF too: one A and one B per fused layer,
B cut per part), at TP 1 and 2 (threads: each rank cuts its shard of A or B), one batched step and a chunked
prefill over cached context. Qwen2 (q/k/v biases) with an adapter on q and v only (k's part of B stays zero)
and rsLoRA scaling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from model_exec.lora.manager import LoRAManager
from model_exec.parallel import TPGroup
from request.lora import LoRARequest
from tests.helpers.family_parity import PREFILL_PROMPTS, assert_logits_match, hf_model
from tests.helpers.lora_models import PHI3_TARGETS, hf_merged_model, make_peft_adapter, our_lora_prefill_logits
from tests.helpers.tiny_models import (
    BOS_ID,
    EOS_ID,
    hf_prefill_logits,
    load_our_model,
    make_tiny_llama,
    make_tiny_model,
    make_tiny_qwen2,
    run_in_rank_threads,
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("lora-llama")
    model = make_tiny_llama(root)
    return model, make_peft_adapter(model, root / "adapter", rank=8, seed=1)


def _unpacked_model(model_dir: str) -> tuple[torch.nn.Module, Any]:
    """Our model with its dense weights (no pack_weights): F.linear, and LoRA's dense products."""
    from model_exec.models import build_model
    from model_exec.source import read_model_config, resolve_model
    from model_exec.weights import iter_weights
    from ops.attention import get_attn_backend

    src = resolve_model(model_dir)
    config = read_model_config(src)
    net = build_model(config, TPGroup.single(), get_attn_backend("torch", "cpu"), "cpu", torch.float32)
    net.load_weights(iter_weights(src))
    return net, config


def _lora_logits(
    model_dir: str,
    adapter: str,
    tp: TPGroup,
    prompts: list[list[int]],
    first_chunk: int | None = None,
    packed: bool = True,
) -> list[torch.Tensor] | None:
    net, config = load_our_model(model_dir, tp) if packed else _unpacked_model(model_dir)
    manager = LoRAManager(net, max_loras=1, max_lora_rank=16)  # type: ignore[arg-type]
    manager.add(LoRARequest("a", 1, adapter))
    for layer in manager.layers.values():  # LoRA runs on the panel kernel exactly where the base layer does
        assert layer.lora is not None
        w = layer.lora.adapters.get(1)  # None: the adapter does not target this layer
        assert w is None or w.panels == (layer.panel_weight is not None)
    return our_lora_prefill_logits(net, manager, config, prompts, [1] * len(prompts), tp, first_chunk=first_chunk)


def _assert_matches_merged(model_dir: str, adapter: str, world_sizes: tuple[int, ...], atol: float = 1e-4) -> None:
    ref = hf_prefill_logits(hf_merged_model(model_dir, adapter), PREFILL_PROMPTS)
    base = hf_prefill_logits(hf_model(model_dir), PREFILL_PROMPTS)
    assert all((r - b).abs().max() > 0.1 for r, b in zip(ref, base, strict=True)), "the adapter must matter"
    for ws in world_sizes:
        results = run_in_rank_threads(ws, lambda tp: _lora_logits(model_dir, adapter, tp, PREFILL_PROMPTS))
        assert all(r is None for r in results[1:])
        assert_logits_match(results[0], ref, atol)


@pytest.mark.parametrize("world_size", [1, 2])
def test_llama_prefill_with_adapter_matches_hf_merged(llama: tuple[str, str], world_size: int) -> None:
    _assert_matches_merged(*llama, world_sizes=(world_size,))


def test_llama_dense_weights_with_adapter_match_hf_merged(llama: tuple[str, str]) -> None:
    """The road without the panel kernel (CUDA, oneDNN or dense CPU weights): LoRA's products through matmul."""
    model, adapter = llama
    ours = _lora_logits(model, adapter, TPGroup.single(), PREFILL_PROMPTS, packed=False)
    assert_logits_match(ours, hf_prefill_logits(hf_merged_model(model, adapter), PREFILL_PROMPTS))


def test_llama_chunked_prefill_over_cached_context_with_adapter(llama: tuple[str, str]) -> None:
    model, adapter = llama
    prompts = [p for p in PREFILL_PROMPTS if len(p) > 3]
    ours = _lora_logits(model, adapter, TPGroup.single(), prompts, first_chunk=3)
    assert_logits_match(ours, hf_prefill_logits(hf_merged_model(model, adapter), prompts))


def test_phi3_fused_adapter_matches_hf_merged(tmp_path: Path) -> None:
    from transformers import Phi3Config

    config = Phi3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.3,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    model = make_tiny_model(tmp_path / "phi3", config)
    adapter = make_peft_adapter(model, tmp_path / "adapter", rank=4, seed=2, targets=PHI3_TARGETS, alpha=8)
    _assert_matches_merged(model, adapter, world_sizes=(1, 2))


def test_qwen2_adapter_on_q_and_v_with_rslora(tmp_path: Path) -> None:
    model = make_tiny_qwen2(tmp_path)
    adapter = make_peft_adapter(
        model, tmp_path / "adapter", rank=16, seed=3, targets=("q_proj", "v_proj", "down_proj"), use_rslora=True
    )
    _assert_matches_merged(model, adapter, world_sizes=(2,))


def test_qwen2_moe_adapter_on_attention_shared_expert_and_dense_mlp(tmp_path: Path) -> None:
    """Every projection targeted: HF's MoE experts are fused parameters, not Linear modules, so PEFT adapts the
    attention, the shared expert (a row-parallel down_proj whose partial sum the MoE block reduces together with
    the experts') and the dense layer's MLP; the routed experts stay the base model's."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        use_sliding_window=False,
        initializer_range=0.3,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    model = make_tiny_model(tmp_path / "qwen2-moe", config)
    adapter = make_peft_adapter(model, tmp_path / "adapter", rank=8, seed=4)
    _assert_matches_merged(model, adapter, world_sizes=(1, 2))


def _family_config(family: str) -> object:
    from transformers import Gemma2Config, Gemma3TextConfig

    from tests.model_exec.families.test_gemma2 import TINY_GEMMA2
    from tests.model_exec.families.test_gemma3 import TINY_GEMMA3
    from tests.model_exec.families.test_qwen3 import qwen3_config

    if family == "gemma2":
        return Gemma2Config(**TINY_GEMMA2)
    if family == "gemma3":
        return Gemma3TextConfig(**TINY_GEMMA3)
    return qwen3_config()


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3"])
def test_other_families_with_every_projection_adapted(family: str, tmp_path: Path) -> None:
    """Families with their own attention or MLP modules (Gemma 2/3: GELU MLP, soft-caps, sandwich norms; Qwen3:
    q/k norms between the projection and the rotation) take adapters through the same linear layers."""
    model = make_tiny_model(tmp_path / family, _family_config(family))
    adapter = make_peft_adapter(model, tmp_path / "adapter", rank=8, seed=5, weights_scale=0.5)
    _assert_matches_merged(model, adapter, world_sizes=(2,))


def test_targets_named_by_path_adapt_only_those_layers(llama: tuple[str, str], tmp_path: Path) -> None:
    """PEFT's target_modules entries match a module's name or its dotted suffix: layer 1's q_proj alone, v_proj
    everywhere. The other layers' q_proj have no weights and are not expected to."""
    model, _ = llama
    targets = ("model.layers.1.self_attn.q_proj", "v_proj")
    adapter = make_peft_adapter(model, tmp_path / "adapter", rank=4, seed=6, targets=targets)
    _assert_matches_merged(model, adapter, world_sizes=(1,))
