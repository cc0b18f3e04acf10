"""LoRA prefill logits against Hugging Face with the adapter merged into its weights (PEFT's merge_and_unload).

Llama (q, k, v, o, gate, up, down as separate HF modules: each stacked part of qkv_proj and gate_up_proj
gets its own A and B) and Phi-3 (qkv_proj and gate_up_proj fused in HF too: one A and one B per fused layer,
B cut per part), at TP 1 and 2 (threads: each rank cuts its shard of A or B), one batched step and a chunked
prefill over cached context. Qwen2 (q/k/v biases) with an adapter on q and v only (k's part of B stays zero)
and rsLoRA scaling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_exec.lora.manager import LoRAManager
from model_exec.parallel import TPGroup
from scheduler.lora import LoRARequest
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


def _lora_logits(
    model_dir: str, adapter: str, tp: TPGroup, prompts: list[list[int]], first_chunk: int | None = None
) -> list[torch.Tensor] | None:
    net, config = load_our_model(model_dir, tp)
    manager = LoRAManager(net, max_loras=1, max_lora_rank=16)  # type: ignore[arg-type]
    manager.add(LoRARequest("a", 1, adapter))
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
