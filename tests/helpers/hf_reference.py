"""The Hugging Face transformers model on the same weights: the correctness reference for the tests."""

from __future__ import annotations

import torch

from model_exec.source import ModelSource


def load_hf_reference_model(src: ModelSource, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Builds the whole HF model in memory (unlike our loader): for tests only."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **kwargs)
    return model.eval()
