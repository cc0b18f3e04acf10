"""A PEFT LoRA checkpoint's tensors, read and grouped by the HF module they adapt.

PEFT saves `base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]) per adapted
module (an adapter name may sit before `.weight` in checkpoints saved by hand). Anything else (embedding
adapters, DoRA magnitudes, LoRA biases) is refused by name: applying only part of an adapter would be wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from request.lora import LoRAError

_LORA_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class ModulePair:
    """One adapted module's matrices, as PEFT stores them (scaling not applied)."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]


def read_lora_tensors(weights_file: str) -> dict[str, torch.Tensor]:
    """Every tensor of adapter_model.safetensors (or .bin, read with weights_only), on the CPU."""
    try:
        if weights_file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(weights_file, device="cpu")
        loaded = torch.load(weights_file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: whatever the reader raised, said in the message
        raise LoRAError(f"cannot read {weights_file}: {type(e).__name__}: {e}") from None
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise LoRAError(f"{weights_file} does not hold a name -> tensor dictionary")
    return loaded


def group_by_module(tensors: dict[str, torch.Tensor], where: str) -> dict[str, ModulePair]:
    """HF module name (model.layers.3.self_attn.q_proj) -> its A and B; LoRAError (prefixed by `where`, the
    adapter) for a tensor that is not a LoRA matrix, a module with only one of A and B, or a matrix that is
    not 2-D."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _LORA_TENSOR.match(name)
        if m is None:
            raise LoRAError(f"{where}: tensor {name!r} is not a LoRA A or B matrix (unsupported adapter content)")
        if tensor.dim() != 2:
            raise LoRAError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, a 2-D matrix is expected")
        halves.setdefault(m["module"], {})[m["ab"]] = tensor
    pairs: dict[str, ModulePair] = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAError(f"{where}: module {module!r} has no {missing} weights")
        pairs[module] = ModulePair(ab["A"], ab["B"])
    return pairs
