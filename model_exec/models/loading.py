"""Loading a checkpoint into a model built at its shard shapes: the part every family shares.

A model class declares how checkpoint names map onto its parameters (`packed_modules_mapping` for
layers the checkpoint stores as separate tensors, `fused_checkpoint_modules` for layers it stores
already fused, and `checkpoint_param` for anything a table cannot say, e.g. one expert of a fused
expert tensor); the tensors stream through here one at a time and each parameter's `weight_loader`
cuts its own shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from model_exec.layers.linear import FUSED, default_weight_loader

ShardId = str | int | None


class CheckpointLoader(nn.Module):
    """Mixin for model classes: `load_weights` from (HF name, full tensor) pairs."""

    # fused parameter -> the checkpoint tensors it is stacked from, in order
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    # fused parameter -> the shard id its weight_loader expects for each entry above
    packed_shard_ids: ClassVar[dict[str, tuple[ShardId, ...]]] = {}
    # fused parameters the checkpoint holds whole (Phi-3's qkv_proj, gate_up_proj): loaded with shard id
    # FUSED, their weight_loader splits the parts and cuts each rank's slice of each
    fused_checkpoint_modules: ClassVar[tuple[str, ...]] = ()
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
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard_id)
            loaded[param_name].add(shard_id)
        missing = sorted(n for n in params if len(loaded[n]) < self.shards_expected(n))
        if missing:
            raise ValueError(f"checkpoint has no weights for {len(missing)} parameters, e.g. {missing[:5]}")
