"""A PEFT LoRA checkpoint's adapter_config.json, read and checked without torch.

The controller checks an adapter with this before any worker loads it, so a bad path, a rank over
`max_lora_rank` or an unsupported feature is a 400 naming the adapter (LoRAError) and the engine keeps serving;
the workers read the same config when they load the weights.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from request.lora import LoRAError, LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Modules an adapter may target: the projections of every registered family, by their HF names. Embeddings and
# the LM head are not adapted (vLLM's extra-vocabulary LoRA is not supported).
SUPPORTED_TARGETS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"}
)


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: frozenset[str]  # module names (the last component: q_proj, down_proj, ...)
    weights_file: str  # absolute path of the adapter's weights
    # target_modules as written: PEFT adapts a module whose name equals an entry or ends with "." + entry, so
    # "model.layers.0.self_attn.q_proj" adapts layer 0 only; () means every module named in target_modules
    target_names: tuple[str, ...] = ()

    def targets(self, module: str) -> bool:
        """Whether PEFT adapted the HF module `module` (model.layers.3.self_attn.q_proj) under this config."""
        if not self.target_names:
            return module.rpartition(".")[2] in self.target_modules
        return any(module == t or module.endswith(f".{t}") for t in self.target_names)


def read_adapter_config(lora: LoRARequest, max_lora_rank: int) -> AdapterConfig:
    """The adapter's config, or LoRAError naming the adapter and what is wrong."""
    where = f"LoRA adapter {lora.lora_name!r} at {lora.lora_path!r}"
    path = os.path.join(lora.lora_path, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{where}: no {CONFIG_FILE} there (a PEFT LoRA checkpoint folder is needed).") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"{where}: cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} is not a JSON object.")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {raw.get('peft_type')!r} is not LORA.")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{where}: r must be a positive integer, got {rank!r}.")
    if rank > max_lora_rank:
        raise LoRAError(f"{where}: rank {rank} is over max_lora_rank={max_lora_rank}.", code="lora_rank_exceeded")
    # Settings that change the arithmetic or the weights' layout; each off (or absent) is plain LoRA.
    offs: dict[str, object] = {
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    unsupported = [f"{key}={raw[key]!r}" for key, off in offs.items() if raw.get(key) not in (None, off)]
    if raw.get("bias", "none") != "none":
        unsupported.append(f"bias={raw['bias']!r}")
    if unsupported:
        raise LoRAError(f"{where}: unsupported adapter settings: {', '.join(unsupported)}.")
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise LoRAError(f"{where}: target_modules must be a list of module names, got {targets!r}.")
    names = frozenset(str(t).rsplit(".", 1)[-1] for t in targets)
    bad = sorted(names - SUPPORTED_TARGETS)
    if bad:
        raise LoRAError(f"{where}: cannot adapt {', '.join(bad)} (supported: {', '.join(sorted(SUPPORTED_TARGETS))}).")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)):
        raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}.")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    weights = next(
        (os.path.join(lora.lora_path, w) for w in WEIGHT_FILES if os.path.isfile(os.path.join(lora.lora_path, w))), None
    )
    if weights is None:
        raise LoRAError(f"{where}: no {' or '.join(WEIGHT_FILES)} there.")
    return AdapterConfig(
        rank=rank,
        scaling=float(scaling),
        target_modules=names,
        weights_file=weights,
        target_names=tuple(str(t) for t in targets),
    )
