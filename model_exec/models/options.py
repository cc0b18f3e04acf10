"""A family's `DecoderSpec` (its registry row) resolved against one checkpoint's config.json: the values the
decoder's layers take, each checked as HF's config class would have it.

Kept apart from the modules (decoder.py) so the checks and the rope-per-layer-type reading can be tested
without building a model.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from model_exec.architectures import DecoderSpec
from model_exec.config import ModelConfig, _normalise_rope, hf_layer_types

if TYPE_CHECKING:
    from torch import nn

    from model_exec.parallel import TPGroup

LAYER_TYPES = ("full_attention", "sliding_attention")
# builds layer i's MLP (a MoE block), or None where the layer has the dense gated MLP
MlpFactory = Callable[[ModelConfig, "TPGroup", int], "nn.Module | None"]


def _optional_positive(hf: Mapping[str, Any], name: str) -> float | None:
    value = hf.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"config.json: {name} must be a positive number or null, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DecoderOptions:
    """A spec and the per-checkpoint values of its fields."""

    spec: DecoderSpec
    attn_scale: float  # the attention's softmax scale
    attn_soft_cap: float | None
    final_soft_cap: float | None

    @classmethod
    def parse(cls, config: ModelConfig, spec: DecoderSpec) -> DecoderOptions:
        hf = config.hf
        for name, why in spec.refused:
            if hf.get(name):
                raise ValueError(f"{config.architecture}: config.json sets {name}, {why}")
        scale = config.head_dim**-0.5
        if spec.attn_scale_key is not None:
            scalar = _optional_positive(hf, spec.attn_scale_key)
            if scalar is None:
                raise ValueError(f"config.json: {spec.attn_scale_key} is required for {config.architecture}")
            scale = scalar**-0.5
        return cls(
            spec=spec,
            attn_scale=scale,
            attn_soft_cap=_optional_positive(hf, spec.attn_soft_cap_key) if spec.attn_soft_cap_key else None,
            final_soft_cap=_optional_positive(hf, spec.final_soft_cap_key) if spec.final_soft_cap_key else None,
        )


def mlp_factory(spec: DecoderSpec) -> MlpFactory | None:
    """The spec's "module:function" MLP factory, imported; None for the gated MLP everywhere."""
    if spec.mlp is None:
        return None
    module, _, name = spec.mlp.partition(":")
    factory: MlpFactory = getattr(importlib.import_module(module), name)
    return factory


def layer_types(config: ModelConfig) -> list[str]:
    """Each layer's type, "full_attention" or "sliding_attention" (from `layer_types` or
    `sliding_window_pattern`; every layer full if the config has neither)."""
    hf = config.hf
    types = hf_layer_types(hf.get("layer_types"), hf.get("sliding_window_pattern"), config.num_hidden_layers)
    types = types or ["full_attention"] * config.num_hidden_layers
    if len(types) != config.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"config.json: layer_types must be one of {LAYER_TYPES} per layer, got {types!r}")
    return types


def rope_by_layer_type(config: ModelConfig, local_theta_key: str) -> dict[str, ModelConfig]:
    """`config` with each layer type's rope_theta and rope_scaling (checked as ModelConfig checks any).

    transformers 5 writes `rope_parameters` keyed by layer type; older config.json forms give the global
    layers' `rope_theta`/`rope_scaling` and the sliding layers' theta in `local_theta_key` (HF's config
    class fills a missing theta from these fields; their defaults are in the registry row)."""
    hf = config.hf
    params = hf.get("rope_parameters")
    if params is None:
        by_type: dict[str, dict[str, Any]] = {
            "full_attention": {"rope_type": "default", **(hf.get("rope_scaling") or {})},
            "sliding_attention": {"rope_type": "default"},
        }
    elif isinstance(params, dict) and set(params) <= set(LAYER_TYPES):
        by_type = {t: dict(params.get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    else:
        raise ValueError(
            f"config.json: {config.architecture}'s rope_parameters must be keyed by {LAYER_TYPES}, got {params!r}"
        )
    by_type["full_attention"].setdefault("rope_theta", hf["rope_theta"])
    by_type["sliding_attention"].setdefault("rope_theta", hf[local_theta_key])
    out = {}
    for layer_type, p in by_type.items():
        theta, scaling, _ = _normalise_rope(SimpleNamespace(rope_parameters=p), config.max_position_embeddings)
        out[layer_type] = replace(config, rope_theta=theta, rope_scaling=scaling)
    return out
