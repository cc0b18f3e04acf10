"""Random PEFT LoRA adapters for the tiny models of tests/helpers/tiny_models.py, and HF's merged reference.

    model_dir = make_tiny_llama(tmp_path)
    adapter = make_peft_adapter(model_dir, tmp_path / "sql", rank=8, seed=1)   # a PEFT checkpoint folder
    llm.generate(..., lora_request=LoRARequest("sql", 1, adapter))
    reference = hf_merged_model(model_dir, adapter)                          # HF with the adapter merged

`our_lora_prefill_logits` runs raytp's model (no engine) with a LoRAManager, one adapter per prompt.

Every adapter has non-zero B (`init_lora_weights=False`), so it really changes the logits; different seeds
give different adapters. Saved with PEFT's own `save_pretrained` (adapter_config.json +
adapter_model.safetensors), exactly what users hand to vLLM.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from model_exec.parallel import TPGroup
from tests.helpers.tiny_models import our_prefill_logits

# every projection of a Llama-shaped decoder layer, by HF module name
LLAMA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's checkpoints (and HF's Phi3 modules) hold q/k/v and gate/up fused
PHI3_TARGETS: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def make_peft_adapter(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    rank: int = 8,
    seed: int = 0,
    targets: Sequence[str] = LLAMA_TARGETS,
    alpha: float = 16,
    use_rslora: bool = False,
    weights_scale: float = 1.0,
) -> str:
    """A random LoRA adapter for the HF model in `model_dir`, saved by PEFT into `out_dir`; returns out_dir.

    `weights_scale` multiplies A and B (1.0: PEFT's random init, which moves a tiny model's logits by ~1).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,  # B random too: the adapter changes the output
        use_rslora=use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, config)
    if weights_scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    param.mul_(weights_scale)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


@functools.lru_cache(maxsize=8)
def hf_merged_model(model_dir: str, adapter_dir: str) -> torch.nn.Module:
    """HF's model from `model_dir` with the adapter in `adapter_dir` merged into its weights (fp32, eval):
    the reference a LoRA forward must match."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


@torch.inference_mode()
def our_lora_prefill_logits(
    net: torch.nn.Module,
    manager: Any,  # model_exec.lora.manager.LoRAManager attached to `net`
    config: Any,
    prompts: list[list[int]],
    lora_ids: list[int],
    tp: TPGroup | None = None,
    block_size: int = 4,
    first_chunk: int | None = None,
) -> list[torch.Tensor] | None:
    """tiny_models.our_prefill_logits with prompt i run under adapter lora_ids[i] (0: the base model): the
    LoRA context of each step is built from the rows as the model runner builds it. None on ranks other than 0."""
    return our_prefill_logits(
        net,
        config,
        prompts,
        tp,
        block_size,
        first_chunk,
        lambda meta: manager.batch(lora_ids, meta.query_start_loc.tolist()),
    )
