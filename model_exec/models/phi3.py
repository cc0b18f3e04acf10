"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama decoder, loaded from a checkpoint with fused projections.

The checkpoint stores `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up] rows) as one tensor
each; every TP rank cuts its q, k, v (gate, up) slices out of the full tensor (`linear.FUSED`), so a
rank's parameter has the layout the Llama layers expect. What else Phi-3 uses is shared: partial rotary
(`partial_rotary_factor`, Phi-4-mini), longrope (`rope_scaling` with short/long factors and the top-level
`original_max_position_embeddings`; layers/rotary.py says how the factors are chosen per step) and one
sliding window for every layer (`sliding_window`). HF's residual dropouts are identities at inference.
"""

from __future__ import annotations

from typing import ClassVar

from model_exec.models.llama import LlamaForCausalLM
from model_exec.models.loading import ShardId


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    packed_shard_ids: ClassVar[dict[str, tuple[ShardId, ...]]] = {}
    fused_checkpoint_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "gate_up_proj")
