"""The Hugging Face transformers model on the same weights: the correctness reference for the tests and for
benchmarks/gpu_check.py (one greedy `generate`, so every parity check compares with the same thing)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from model_exec.source import ModelSource


def load_hf_reference_model(src: ModelSource, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Builds the whole HF model in memory (unlike our loader): for tests only."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **kwargs)
    return model.eval()


@torch.inference_mode()
def hf_greedy_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new: int, **extra: Any) -> Any:
    """HF's greedy `generate` of exactly `max_new` tokens after each of `prompts` (equal lengths: no padding;
    no EOS stop, sampling knobs off), on the model's device; `extra`: more generate arguments (e.g.
    output_logits=True, return_dict_in_generate=True)."""
    ids = torch.tensor([list(p) for p in prompts], device=next(model.parameters()).device)
    return model.generate(  # type: ignore[operator]
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        eos_token_id=None,
        pad_token_id=0,
        temperature=None,
        top_p=None,
        top_k=None,
        **extra,
    )
