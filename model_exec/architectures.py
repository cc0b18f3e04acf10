"""The one registry of model architectures, torch-free: the controller refuses an unsupported model before
any worker starts (`model_exec.config`), and the workers build the class it names (`model_exec.models`).

A model family is one file under `model_exec/models/` and one row here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    model_type: str  # the HF config's `model_type`: names the architecture when a config has no `architectures`
    module: str  # where the class lives (imported lazily, in the workers only)
    class_name: str
    gguf_arch: str | None = None  # GGUF `general.architecture` that loads into it (None: safetensors only)
    notes: str = ""  # one line for README's table of models: the family's quirks raytp implements


# HF `architectures[0]` -> the implementation
ARCHITECTURES: Mapping[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        "llama", "model_exec.models.llama", "LlamaForCausalLM", "llama", "Llama 2/3.x, SmolLM2; rope scaling"
    ),
    "MistralForCausalLM": Architecture(
        "mistral", "model_exec.models.llama", "LlamaForCausalLM", "llama", "sliding-window attention"
    ),
    "Qwen2ForCausalLM": Architecture(
        "qwen2", "model_exec.models.llama", "LlamaForCausalLM", "qwen2", "q/k/v biases; per-layer windows"
    ),
    "Qwen3ForCausalLM": Architecture(
        "qwen3",
        "model_exec.models.qwen3",
        "Qwen3ForCausalLM",
        None,
        "per-head q/k RMSNorm; head_dim apart from hidden size; attention_bias; rope scaling",
    ),
    "Phi3ForCausalLM": Architecture(
        "phi3",
        "model_exec.models.phi3",
        "Phi3ForCausalLM",
        None,
        "Phi-3, Phi-4: fused qkv/gate_up checkpoints; partial rotary; longrope; sliding window",
    ),
}
# model_type -> architecture, for configs that carry no `architectures` (e.g. those parsed from GGUF)
ARCHITECTURE_BY_MODEL_TYPE: Mapping[str, str] = {a.model_type: name for name, a in ARCHITECTURES.items()}
