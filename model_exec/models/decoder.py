"""The one decoder-only transformer every family builds, tensor-parallel, from its registry row's
`DecoderSpec` (model_exec/architectures.py; the values it names are read by models/options.py).

Llama's layer is the default: pre-norm attention and gated MLP, fused residual adds, one rope. A spec
turns on, each as HF's code for that family does it:
- Gemma's RMSNorm (x / rms(x) * (1 + weight) in float32) for every norm, and the embedding output times
  sqrt(hidden_size), that factor first rounded to the model dtype;
- sandwich norms: the attention and MLP outputs are normed before they join the residual;
- a per-head norm on q and k before the rotation (Qwen3, Gemma 3);
- the attention scale from a config field, attention-score and final-logit soft-caps (the latter applied
  on rank 0's gathered full-vocabulary logits);
- rope per layer type (local/global layers with their own theta and scaling) besides per-layer sliding
  windows and partial rotary, which every family reads from `ModelConfig`;
- a factory for each layer's MLP (the MoE families, models/moe_blocks.py);
- checkpoint naming: fused or stacked q/k/v and gate/up, renamed module paths.
Every layer is built at its per-rank shard shape. The per-layer choices are made at construction; a
forward only tests which modules a layer has (no per-token Python).

`forward` returns the final hidden states (after the last norm), `compute_logits` turns the rows the
caller picks into logits: embedders and the sampler take the same forward.
"""

from __future__ import annotations

import torch
from torch import nn

from model_exec.architectures import ARCHITECTURES, DecoderSpec
from model_exec.config import ModelConfig
from model_exec.layers.activation import act_and_mul
from model_exec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_exec.layers.linear import GateUpParallelLinear, QKVParallelLinear, RowParallelLinear
from model_exec.layers.norm import GemmaRMSNorm, RMSNorm, per_head_norm
from model_exec.layers.quantization import row_roads
from model_exec.layers.rotary import RopeAngles, RotaryEmbedding
from model_exec.models import fused_decode
from model_exec.models.loading import (
    STACKED_QKV_GATE_UP,
    STACKED_QKV_GATE_UP_SHARD_IDS,
    ExpertCheckpointLoader,
    ShardId,
)
from model_exec.models.options import LAYER_TYPES, DecoderOptions, layer_types, mlp_factory, rope_by_layer_type
from model_exec.parallel import TPGroup
from ops.attention.base import AttentionBackend, AttentionMetadata
from ops.fused_decode import decode_layer


def norm_class(spec: DecoderSpec) -> type[RMSNorm]:
    return GemmaRMSNorm if spec.gemma_norm else RMSNorm


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with HF's `hidden_act`; `reduce_results=False` leaves the all-reduce to
    the caller (a shared expert summed into the routed experts' partial sums first)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(hidden_size, intermediate_size, bias, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp, dtype, reduce_results)
        # silu: the projection's own silu_and_mul (one fused GEMM + activation on the CPU's panels)
        self.act = None if hidden_act == "silu" else act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        options: DecoderOptions,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        layer: int,
    ) -> None:
        super().__init__()
        spec, dtype = options.spec, config.torch_dtype
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
            tp=tp,
            params_dtype=dtype,
        )
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, config.o_bias, tp, dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.qkv_proj.q_size
        self.qk_size = self.qkv_proj.q_size + self.qkv_proj.kv_size
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm:
            norm = norm_class(spec)
            self.q_norm = norm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = norm(config.head_dim, config.rms_norm_eps, dtype)
        self.attn = attn_backend(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            options.attn_scale,
            sliding_window=config.layer_window(layer),
            logits_soft_cap=options.attn_soft_cap,
        )

    def forward(
        self,
        rope: RopeAngles,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        num_tokens = hidden.shape[0]
        if self.q_norm is None or self.k_norm is None:
            # q and k sit side by side in the fused output: one rotation covers both (qkv is this call's own
            # tensor, so it may be rotated in place); q and k reach the backend as [T, heads, head_dim] views
            # with a contiguous last dim and strided rows.
            qk = RotaryEmbedding.rotate_owned(
                rope, qkv[:, : self.qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            )
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # two views (Tensor.split is Python, ~2x the cost)
        else:  # the norms write new tensors, which the rotations then own
            q = RotaryEmbedding.rotate_owned(rope, per_head_norm(self.q_norm, qkv[:, : self.q_size], self.num_heads))
            k = RotaryEmbedding.rotate_owned(
                rope, per_head_norm(self.k_norm, qkv[:, self.q_size : self.qk_size], self.num_kv_heads)
            )
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: Attention, mlp: nn.Module, spec: DecoderSpec) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        norm = norm_class(spec)
        size, eps, dtype = config.hidden_size, config.rms_norm_eps, config.torch_dtype
        self.input_layernorm = norm(size, eps, dtype)
        # the checkpoint's names: with sandwich norms post_attention_layernorm norms the attention output and
        # pre_feedforward_layernorm the MLP input; without, post_attention_layernorm is the MLP input's norm
        self.post_attention_layernorm = norm(size, eps, dtype)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = norm(size, eps, dtype)
            self.post_feedforward_layernorm = norm(size, eps, dtype)

    def fused_decode_plan(self, rotary_dim: int) -> fused_decode.LayerPlan | None:
        """The one-call decode op's arguments for this layer when it has Llama's shape (models/fused_decode.py
        says what else it needs), else None; raises `fused_decode.Pending` before the weights are packed."""
        attn, mlp = self.self_attn, self.mlp
        if attn.q_norm is not None or self.pre_feedforward_layernorm is not None:
            return None  # q/k norms, sandwich norms
        if not isinstance(mlp, GatedMLP) or mlp.act is not None:
            return None  # MoE, non-SiLU activations
        return fused_decode.layer_plan(
            self.input_layernorm,
            self.post_attention_layernorm,
            attn.qkv_proj,
            attn.o_proj,
            mlp.gate_up_proj,
            mlp.down_proj,
            attn.attn,
            rotary_dim,
        )

    def forward(
        self,
        rope: RopeAngles,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # `residual` is the un-normalised stream; `hidden` the previous block's output, not yet added to it:
        # each norm's fused add puts it in (HF adds right after the block, or its post-norm: the same sum).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def rotary_embeddings(config: ModelConfig, spec: DecoderSpec) -> tuple[list[RotaryEmbedding], list[int]]:
    """The model's rotary embeddings and, per layer, the index of the one it uses: one for every layer, or
    one per layer type, each layer using its type's (as HF, whether or not the type's layers window)."""
    if spec.local_rope_theta_key is None:
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, config.rotary_dim
        )
        return [rotary], [0] * config.num_hidden_layers
    ropes = rope_by_layer_type(config, spec.local_rope_theta_key)
    rotaries = [
        RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, c.rotary_dim)
        for c in (ropes[t] for t in LAYER_TYPES)
    ]
    return rotaries, [LAYER_TYPES.index(t) for t in layer_types(config)]


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        options: DecoderOptions,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
    ) -> None:
        super().__init__()
        spec, dtype = options.spec, config.torch_dtype
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        # HF Gemma: torch.tensor(sqrt(hidden)).to(weight dtype), so in bfloat16 sqrt(3072) = 55.43 becomes 55.5
        self.embed_scale: torch.Tensor | None
        scale = torch.tensor(config.hidden_size**0.5).to(dtype) if spec.embed_scale else None
        self.register_buffer("embed_scale", scale, persistent=False)
        rotaries, self.layer_rotary = rotary_embeddings(config, spec)
        self.rotary_embs = nn.ModuleList(rotaries)  # shared by the layers (their caches are not in state_dict)
        make_mlp = mlp_factory(spec)
        layers = []
        for i in range(config.num_hidden_layers):
            mlp = make_mlp(config, tp, i) if make_mlp is not None else None
            if mlp is None:
                mlp = GatedMLP(
                    config.hidden_size,
                    config.intermediate_size,
                    config.hidden_act,
                    config.mlp_bias,
                    tp,
                    dtype,
                )
            layers.append(DecoderLayer(config, Attention(config, options, tp, attn_backend, i), mlp, spec))
        self.layers = nn.ModuleList(layers)
        self.norm = norm_class(spec)(config.hidden_size, config.rms_norm_eps, dtype)
        # the one-call decode layers (models/fused_decode.py): None until decided (after packing), then a plan
        # per layer, or False where some layer does not fit
        self._fused: list[fused_decode.LayerPlan] | bool | None = None if fused_decode.wanted() else False

    def fused_decode_plans(self) -> list[fused_decode.LayerPlan] | None:
        """Every layer's one-call decode plan, or None when some layer does not fit (decided once the
        weights are in their final layout; weights never load again after packing)."""
        if self._fused is None:
            try:
                plans = [
                    layer.fused_decode_plan(self.rotary_embs[r].rotary_dim)  # type: ignore[operator]
                    for layer, r in zip(self.layers, self.layer_rotary, strict=True)
                ]
            except fused_decode.Pending:
                return None
            self._fused = False if any(p is None for p in plans) else plans
        return self._fused if isinstance(self._fused, list) else None

    def _decode_step_plans(
        self, hidden: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
    ) -> list[fused_decode.LayerPlan] | None:
        """The plans when this step can run one call per layer: every row a decode row, fp32 on the CPU, and
        its rows' GGUF roads all one (a one-token prompt chunk beside generated rows runs the layers, which split
        the rows by road: quantization/row_roads.py)."""
        if meta.num_decodes != hidden.shape[0] or hidden.dtype != torch.float32 or not hidden.is_cpu:
            return None
        roads = row_roads.for_rows(hidden.shape[0])
        if roads is not None and roads.road == row_roads.BY_ROWS:
            return None
        if kv_caches[0][0].dtype != torch.float32:
            return None
        return self.fused_decode_plans()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} (key, value) cache pairs, got {len(kv_caches)}")
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden.mul_(self.embed_scale)
        # once per step, not per layer
        ropes = [rotary.angles(positions, hidden.dtype, meta) for rotary in self.rotary_embs]  # type: ignore[operator]
        residual: torch.Tensor | None = None
        plans = self._decode_step_plans(hidden, kv_caches, meta)
        if plans is not None:  # a decode step on the CPU road: one C++ call per layer, the same kernels' bits
            slots, tables, lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
            roads = row_roads.for_rows(hidden.shape[0])
            gguf_road = row_roads.BY_ROWS if roads is None else roads.road
            for p, rotary, (key_cache, value_cache) in zip(plans, self.layer_rotary, kv_caches, strict=True):
                rope = ropes[rotary]
                hidden, residual = decode_layer(
                    hidden, residual, p.weights, p.plan, p.eps, p.scale, p.soft_cap, rope.cos, rope.sin,
                    key_cache, value_cache, slots, tables, lens, gguf_road,
                )  # fmt: skip
        else:
            for layer, rotary, kv_cache in zip(self.layers, self.layer_rotary, kv_caches, strict=True):
                hidden, residual = layer(ropes[rotary], hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalDecoder(ExpertCheckpointLoader):
    """The decoder and its LM head; `spec` defaults to the registry row of `config.architecture`."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        spec: DecoderSpec | None = None,
    ) -> None:
        super().__init__()
        config.check_tp(tp.world_size)
        self.config = config
        self.tp = tp
        self.spec = spec if spec is not None else ARCHITECTURES[config.architecture].decoder
        self.options = DecoderOptions.parse(config, self.spec)
        # the checkpoint's names: q/k/v and gate/up stacked into one parameter each, unless stored fused
        fused = self.spec.fused_checkpoint_modules
        self.packed_modules_mapping = {k: v for k, v in STACKED_QKV_GATE_UP.items() if k not in fused}
        self.packed_shard_ids = {k: v for k, v in STACKED_QKV_GATE_UP_SHARD_IDS.items() if k not in fused}
        self.fused_checkpoint_modules = fused
        self.model = DecoderModel(config, self.options, tp, attn_backend)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, config.torch_dtype, tied)

    def checkpoint_param(self, ckpt_name: str) -> tuple[str, ShardId] | None:
        for old, new in self.spec.checkpoint_renames:
            ckpt_name = ckpt_name.replace(old, new)
        return super().checkpoint_param(ckpt_name)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] packed tokens of all rows
        positions: torch.Tensor,  # [T] int64 position of each token in its sequence
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key_cache, value_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: the final norm's output
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> full-vocabulary logits [N, vocab] on rank 0 (soft-capped there), None elsewhere."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.options.final_soft_cap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # HF's order of operations
