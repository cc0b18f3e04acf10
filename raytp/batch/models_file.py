"""`raytp batch --models-file FILE`: the models of a batch job that mixes models, from YAML or JSON.

    models:
      - model: /models/llama-3-8b        # any EngineConfig field, as `raytp serve` flags name them
        served_model_name: llama          # what rows send as `model`
        num_replicas: 2                   # this model's engine replicas
        tensor_parallel_size: 2
        enable_lora: true
        lora_modules: [sql=/adapters/sql] # adapters rows may name as `model` (as --lora-modules)
      - model: /models/qwen3-1.7b
        served_model_name: qwen

Each entry's engine settings start from the command line's engine flags, so flags common to every model are
given once. The same entry keys as a Serve config's `args.models` where they overlap.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from cluster.config import EngineConfig
from raytp.batch.runner import BatchModel
from raytp.serve.args import LoRAModule

_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
_OWN_FIELDS = frozenset({"served_model_name", "num_replicas", "lora_modules"})


def read_models_file(path: str | Path, base: EngineConfig, num_replicas: int = 1) -> list[BatchModel]:
    """The file's models (`base` and `num_replicas`: each entry's defaults); ValueError naming the entry and key
    for anything malformed."""
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)  # YAML is a superset of JSON: one reader for both
    entries = doc.get("models") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty list of models under `models:`.")
    return [_model(path, i, entry, base, num_replicas) for i, entry in enumerate(entries)]


def _model(path: str | Path, index: int, entry: Any, base: EngineConfig, num_replicas: int) -> BatchModel:
    where = f"{path}: models[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping of settings, got {type(entry).__name__}.")
    unknown = sorted(set(entry) - _ENGINE_FIELDS - _OWN_FIELDS)
    if unknown:
        raise ValueError(f"{where} has unknown settings: {', '.join(unknown)}.")
    try:
        engine = dataclasses.replace(base, **{k: v for k, v in entry.items() if k in _ENGINE_FIELDS})
        loras = tuple(LoRAModule.parse(m) for m in entry.get("lora_modules") or ())
        return BatchModel(engine, entry.get("served_model_name"), int(entry.get("num_replicas", num_replicas)), loras)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
