"""Loading a checkpoint into a model built at its shard shapes: the part every family shares.

A model class declares how checkpoint names map onto its parameters (`packed_modules_mapping` for
layers the checkpoint stores as separate tensors, `fused_checkpoint_modules` for layers it stores
already fused, and `checkpoint_param` for anything a table cannot say, e.g. one expert of a fused
expert tensor); the tensors stream through here one at a time and each parameter's `weight_loader`
cuts its own shard.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from model_exec.layers.linear import FUSED, default_weight_loader

# what a parameter's weight_loader is told a checkpoint tensor is: a packed part ("q", 0, ...), an
# (expert, "gate" | "up" | "down") of stacked expert weights, or None for the whole tensor
ShardId = str | int | tuple[int, str] | None


# The usual stacking: q, k, v projections into one qkv_proj, gate and up into one gate_up_proj (the shard ids
# are what QKVParallelLinear's and GateUpParallelLinear's weight_loaders expect).
STACKED_QKV_GATE_UP: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
STACKED_QKV_GATE_UP_SHARD_IDS: dict[str, tuple[ShardId, ...]] = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}


class CheckpointLoader(nn.Module):
    """Mixin for model classes: `load_weights` from (HF name, full tensor) pairs."""

    # Per model, not per class (the decoder's come from its spec): a model may set these three on itself.
    # fused parameter -> the checkpoint tensors it is stacked from, in order
    packed_modules_mapping: dict[str, list[str]] = {}
    # fused parameter -> the shard id its weight_loader expects for each entry above
    packed_shard_ids: dict[str, tuple[ShardId, ...]] = {}
    # fused parameters the checkpoint holds whole (Phi-3's qkv_proj, gate_up_proj): loaded with shard id
    # FUSED, their weight_loader splits the parts and cuts each rank's slice of each
    fused_checkpoint_modules: tuple[str, ...] = ()
    # substrings of checkpoint names that hold no parameter (recomputed buffers)
    ignored_checkpoint_tensors: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def checkpoint_param(self, ckpt_name: str) -> tuple[str, ShardId] | None:
        """(parameter name, shard id) that checkpoint tensor `ckpt_name` loads into; None to skip it."""
        if any(part in ckpt_name for part in self.ignored_checkpoint_tensors):
            return None
        config = getattr(self, "config", None)
        if ckpt_name == "lm_head.weight" and config is not None and config.tie_word_embeddings:
            return None
        for packed, parts in self.packed_modules_mapping.items():
            for i, part in enumerate(parts):
                if f".{part}." in ckpt_name:
                    return ckpt_name.replace(f".{part}.", f".{packed}."), self.packed_shard_ids[packed][i]
        if any(f".{fused}." in ckpt_name for fused in self.fused_checkpoint_modules):
            return ckpt_name, FUSED
        return ckpt_name, None

    def shards_expected(self, param_name: str) -> int:
        """How many checkpoint tensors make up parameter `param_name`."""
        for packed, parts in self.packed_modules_mapping.items():
            if f".{packed}." in param_name:
                return len(parts)
        return 1

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load from (HF name, full tensor) pairs, streamed; each parameter cuts its own shard.

        Raises ValueError for a checkpoint tensor with no home and for parameters left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, set[ShardId]] = {name: set() for name in params}
        for ckpt_name, tensor in weights:
            target = self.checkpoint_param(ckpt_name)
            if target is None:
                continue
            param_name, shard_id = target
            param = params.get(param_name)
            if param is None:
                arch = getattr(getattr(self, "config", None), "architecture", type(self).__name__)
                raise ValueError(f"checkpoint tensor {ckpt_name!r} matches no parameter of {arch}")
            # a layer's own loader takes its shard ids (experts: (expert, part)); replicated ones take none
            loader: Callable[[nn.Parameter, torch.Tensor, Any], None] = getattr(
                param, "weight_loader", default_weight_loader
            )
            loader(param, tensor, shard_id)
            loaded[param_name].add(shard_id)
        missing = sorted(n for n in params if len(loaded[n]) < self.shards_expected(n))
        if missing:
            raise ValueError(f"checkpoint has no weights for {len(missing)} parameters, e.g. {missing[:5]}")


# one expert's matrix in a checkpoint: "<...>.experts.<e>.<w1|w2|w3|gate_proj|up_proj|down_proj>.weight"
_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")
# checkpoint name -> part of a gated expert: Mixtral's w1/w3/w2, Qwen MoE's (and transformers 5's) names
_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class ExpertCheckpointLoader(CheckpointLoader):
    """CheckpointLoader for models with `layers.moe.FusedMoE` experts (parameters `<...>.experts.gate_up_proj`
    and `<...>.experts.down_proj`, stacked over experts).

    Checkpoints hold either one tensor per expert and projection (published Mixtral and Qwen MoE
    checkpoints, and what transformers 5.24's save_pretrained writes), or transformers 5's in-memory
    stacked tensors `experts.gate_up_proj` [E, 2I, H] ([gate; up] per expert) and `experts.down_proj`
    [E, H, I]; the stacked ones are split into per-expert views on the way in, so one path loads both.
    """

    def checkpoint_param(self, ckpt_name: str) -> tuple[str, ShardId] | None:
        m = _EXPERT_TENSOR.match(ckpt_name)
        if m is not None and m["part"] in _EXPERT_PARTS:
            part = _EXPERT_PARTS[m["part"]]
            param = "down_proj" if part == "down" else "gate_up_proj"
            return f"{m['experts']}.{param}", (int(m["expert"]), part)
        return super().checkpoint_param(ckpt_name)

    def shards_expected(self, param_name: str) -> int:
        if param_name.endswith(".experts.gate_up_proj"):
            return 2 * self.get_parameter(param_name).shape[0]
        if param_name.endswith(".experts.down_proj"):
            return self.get_parameter(param_name).shape[0]
        return super().shards_expected(param_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with stacked expert tensors replaced by per-expert views (no copies)."""
    for name, tensor in weights:
        experts, _, stacked = name.rpartition(".")
        if not experts.endswith(".experts") or stacked not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        if tensor.dim() != 3:
            raise ValueError(f"stacked expert tensor {name!r} has shape {tuple(tensor.shape)}, expected 3 dims")
        for e, matrix in enumerate(tensor.unbind(0)):
            if stacked == "down_proj":
                yield f"{experts}.{e}.down_proj.weight", matrix
                continue
            if matrix.shape[0] % 2:
                raise ValueError(f"stacked expert tensor {name!r} has an odd gate/up dimension {matrix.shape[0]}")
            gate, up = matrix.chunk(2, dim=0)
            yield f"{experts}.{e}.gate_proj.weight", gate
            yield f"{experts}.{e}.up_proj.weight", up
