"""Pre-quantized FP8 checkpoints: which `quantization_config`s load, and how their scale tensors are sharded.

Two formats (vLLM loads both; so does raytp, for the cases below):
- `{"quant_method": "fp8"}` (vLLM's / AutoFP8's): fp8 `weight` + `weight_scale`, `activation_scheme`
  "dynamic" (per-token scales at run time) or "static" (an `input_scale` per tensor). Block-wise checkpoints
  (`weight_block_size`, DeepSeek-style `weight_scale_inv`) are refused by name;
- compressed-tensors (`"quant_method": "compressed-tensors"`, `format` "float-quantized", llm-compressor's
  FP8 and FP8_DYNAMIC schemes, e.g. neuralmagic's Llama-3-*-FP8): one config group of 8-bit float weights
  with strategy "tensor" or "channel", input activations dynamic per token or static per tensor.

Anything else (other formats, group/block strategies, weight-only FP8, FP8 KV-cache scales, layers `ignore`d
other than the LM head) is refused at start with its name: never a silent float load of fp8 bytes.

Scale tensors reach the layer through the same checkpoint names and weight loaders as the weight
(`q_proj.weight_scale` -> `qkv_proj.weight_scale`, shard "q"): a per-channel scale [N] / [N, 1] is cut with
the weight's rows on column-parallel layers and kept whole on row-parallel ones (their rows are not split);
a per-tensor scale is first spread over its tensor's rows, so every layer holds per-channel scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_exec.layers.linear import FUSED, ColumnParallelLinear, LinearBase
from model_exec.layers.quantization.base import copy_shard


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What the layers of a pre-quantized FP8 checkpoint load besides the fp8 weight."""

    describe: str  # e.g. "compressed-tensors float-quantized, weights per channel, dynamic activations"
    static_input: bool  # an `input_scale` tensor per linear layer


_LM_HEAD_ONLY = "lm_head"  # an ignored LM head is ours anyway: raytp's LM head is never quantized


def _check_ignored(ignored: list[str] | None, key: str) -> None:
    others = [name for name in ignored or [] if not name.removeprefix("re:").rstrip("$").endswith(_LM_HEAD_ONLY)]
    if others:
        raise ValueError(f"FP8 checkpoints that keep linear layers in float ({key}: {others[:3]}) are not supported")


def _fp8(config: dict[str, Any]) -> Fp8Checkpoint:
    if config.get("weight_block_size") is not None:
        raise ValueError(
            f"block-wise FP8 checkpoints (weight_block_size={config['weight_block_size']}) are not supported; "
            "supported: per-tensor or per-channel weight scales"
        )
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"FP8 activation_scheme {scheme!r} is not supported; supported: dynamic, static")
    if config.get("kv_cache_scheme") is not None:
        raise ValueError("FP8 KV-cache scales (kv_cache_scheme) are not supported")
    _check_ignored(config.get("ignored_layers"), "ignored_layers")
    return Fp8Checkpoint(f"fp8, {scheme} activations", scheme == "static")


def _compressed_tensors(config: dict[str, Any]) -> Fp8Checkpoint:
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; supported: float-quantized (FP8)")
    if config.get("kv_cache_scheme") is not None:
        raise ValueError("FP8 KV-cache scales (kv_cache_scheme) are not supported")
    _check_ignored(config.get("ignore"), "ignore")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(
            f"compressed-tensors checkpoints with {len(groups)} config groups are not supported; supported: 1"
        )
    group = groups[0]
    if group.get("format", fmt) != fmt:
        raise ValueError(f"compressed-tensors group format {group.get('format')!r} is not supported")
    if "Linear" not in group.get("targets", []):
        raise ValueError(f"compressed-tensors targets {group.get('targets')} are not supported; supported: Linear")
    w = group.get("weights") or {}
    if (w.get("type"), w.get("num_bits"), w.get("strategy")) not in (("float", 8, "tensor"), ("float", 8, "channel")):
        raise ValueError(
            f"compressed-tensors weights {w.get('type')}{w.get('num_bits')} per {w.get('strategy')} are not "
            "supported; supported: float 8-bit per tensor or per channel"
        )
    if w.get("dynamic") or w.get("symmetric") is False:
        raise ValueError("compressed-tensors FP8 weights must be static and symmetric")
    a = group.get("input_activations")
    if a is None:
        raise ValueError("compressed-tensors FP8 weight-only checkpoints (no input_activations) are not supported")
    kind = (a.get("type"), a.get("num_bits"), a.get("strategy"), bool(a.get("dynamic")))
    if kind not in (("float", 8, "token", True), ("float", 8, "tensor", False)):
        raise ValueError(
            f"compressed-tensors input activations {a.get('type')}{a.get('num_bits')} per {a.get('strategy')} "
            f"(dynamic={a.get('dynamic')}) are not supported; supported: dynamic per token, static per tensor"
        )
    static = not kind[3]
    describe = f"compressed-tensors float-quantized, weights per {w['strategy']}, "
    return Fp8Checkpoint(describe + ("static" if static else "dynamic") + " activations", static)


def checkpoint_fp8(quantization_config: dict[str, Any] | None) -> Fp8Checkpoint | None:
    """The checkpoint's FP8 format from its config.json `quantization_config` (None: a float checkpoint).
    Raises ValueError naming any quantization_config raytp cannot load."""
    if quantization_config is None:
        return None
    method = quantization_config.get("quant_method")
    if method == "fp8":
        return _fp8(quantization_config)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config)
    raise ValueError(
        f"checkpoint quantization {method!r} is not supported; supported: fp8, compressed-tensors (float-quantized)"
    )


def _full_rows(layer: LinearBase, shard_id: str | int | None) -> int:
    """Rows of the whole checkpoint tensor `shard_id` names, for a column-parallel layer."""
    assert isinstance(layer, ColumnParallelLinear)
    world = layer.tp.world_size
    if shard_id in (None, FUSED):
        return layer.weight.shape[0] * world
    sizes = {part: size for part, _, size in layer.output_parts()}
    if shard_id not in sizes:
        raise ValueError(f"shard id {shard_id!r} is not a part of this layer ({list(sizes)})")
    return sizes[shard_id] * world


def load_weight_scale(
    layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
) -> None:
    """`weight_scale` (one value, or one per output row) into this rank's rows of `param` [N, 1]."""
    scale = loaded.detach().float().reshape(-1, 1)
    if not isinstance(layer, ColumnParallelLinear):  # row-parallel / replicated: every output row is here
        copy_shard(param.data, scale.expand(param.shape[0], 1) if scale.shape[0] == 1 else scale)
        return
    if scale.shape[0] == 1:
        scale = scale.expand(_full_rows(layer, shard_id), 1)
    layer.weight_loader(param, scale, shard_id)  # cut with the weight's rows, at the part's offset


def load_input_scale(
    layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
) -> None:
    """A static per-tensor `input_scale` into its part's slot of `param` [parts] (the largest is used)."""
    if loaded.numel() != 1:
        raise ValueError(f"input_scale has shape {tuple(loaded.shape)}; static activation scales are per tensor")
    value = loaded.detach().float().reshape(())
    if shard_id in (None, FUSED):
        param.data.fill_(value)
        return
    assert isinstance(layer, ColumnParallelLinear)
    parts = [part for part, _, _ in layer.output_parts()]
    param.data[parts.index(shard_id)] = value
