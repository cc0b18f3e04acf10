"""BERT and XLM-RoBERTa encoders (embeddings) and their sequence-classification cross-encoders (scores).

Tensor-parallel like the decoders (q/k/v and the feed-forward's first matrix column-parallel, the output
projections row-parallel), post-LayerNorm blocks, absolute position embeddings, erf GELU.

Decision: encoder attention runs without the paged KV cache, over the step's packed prompts, each
sequence attending to itself bidirectionally (layers/packed_attention.py: no padded layout, no mask). A
pooling step never reads a key written by an earlier step (no chunked prefill, no prefix cache, no
decode), so paging buys nothing, and the paged backends' kernels are causal by construction: giving each
of them a non-causal mode would touch every backend for a path that needs none of what they do. The
cache pairs the runner passes are unused.

Decision: on an Intel CPU the encoder's fp32 linear layers stay dense and run through torch's MKL
(`dense_cpu_gemm`, honoured by models.pack_weights): a pooling step is thousands of rows, compute-bound,
and there MKL measured ~15% faster per layer than raytp's panels and oneDNN's prepacked layout
(docs/benchmarks.md "embedding"); elsewhere (MKL's generic paths on AMD) the panels stay. Bias adds ride
in MKL's addmm, GELU and the residual adds run in place.

Token types: a BERT pair ([CLS] a [SEP] b [SEP], a cross-encoder's input) has type 0 up to and including
its first [SEP] and 1 after it, exactly as BERT's tokenizer builds `token_type_ids`; the model derives
them from the token ids (`sep_token_id`, set from the tokenizer by model_exec/pooling_model.py), so the
step protocol carries nothing new. XLM-R has one token type.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from model_exec.config import ModelConfig
from model_exec.layers.embedding import VocabParallelEmbedding
from model_exec.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model_exec.layers.packed_attention import packed_bidirectional_attention, sequence_bounds
from model_exec.models.loading import CheckpointLoader, ShardId
from model_exec.parallel import TPGroup
from model_exec.pooling_config import num_labels
from ops.attention.base import AttentionBackend, AttentionMetadata

# Checkpoint name prefixes of the encoder inside a task model (HF's base_model_prefix), stripped on load.
_BASE_PREFIXES = ("bert.", "roberta.", "model.")


class EncoderSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, heads, heads, True, tp, config.torch_dtype
        )
        self.num_heads = self.qkv_proj.num_heads
        self.head_dim = config.head_dim

    def forward(self, hidden: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        return packed_bidirectional_attention(self.qkv_proj(hidden), bounds, self.num_heads, self.head_dim)


class _DenseLayerNorm(nn.Module):
    """HF's BertSelfOutput / BertOutput: LayerNorm(dense(x) + residual)."""

    def __init__(self, config: ModelConfig, tp: TPGroup, input_size: int, eps: float) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, config.hidden_size, True, tp, config.torch_dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=eps, dtype=config.torch_dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x).add_(residual))


class _Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, eps: float) -> None:
        super().__init__()
        self.self = EncoderSelfAttention(config, tp)  # HF's module name: attention.self.query ...
        self.output = _DenseLayerNorm(config, tp, config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        return self.output(self.self(hidden, bounds), hidden)


class _Intermediate(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True, tp, config.torch_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_(self.dense(x))  # erf GELU in place on the fresh product


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, eps: float) -> None:
        super().__init__()
        self.attention = _Attention(config, tp, eps)
        self.intermediate = _Intermediate(config, tp)
        self.output = _DenseLayerNorm(config, tp, config.intermediate_size, eps)

    def forward(self, hidden: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        hidden = self.attention(hidden, bounds)
        return self.output(self.intermediate(hidden), hidden)


class _Encoder(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, eps: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(config, tp, eps) for _ in range(config.num_hidden_layers))


class _Embeddings(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, eps: float) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size, dtype=dtype)
        self.type_vocab_size = int(config.hf.get("type_vocab_size", 2))
        self.token_type_embeddings = nn.Embedding(self.type_vocab_size, config.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)


class BertModel(CheckpointLoader):
    """An encoder's final hidden states, one per token (the pooler makes the embedding)."""

    # An embedding model's checkpoint may carry BERT's pooler (dense + tanh); only classifiers use it.
    skipped_prefixes: ClassVar[tuple[str, ...]] = ("pooler.", "lm_head.", "cls.")
    # XLM-R's positions index the table from padding_idx + 1 (HF: create_position_ids_from_input_ids)
    positions_after_padding_idx: ClassVar[bool] = False
    # fp32 CPU linears stay dense for MKL where MKL has its fast paths (module docstring; models.pack_weights)
    dense_cpu_gemm: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, tp: TPGroup, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        config.check_tp(tp.world_size)
        del attn_backend  # see the module docstring: encoder attention is not paged
        self.config = config
        self.packed_modules_mapping = {"qkv_proj": ["query", "key", "value"]}
        self.packed_shard_ids = {"qkv_proj": ("q", "k", "v")}
        eps = float(config.hf.get("layer_norm_eps", 1e-12))
        self.embeddings = _Embeddings(config, tp, eps)
        self.encoder = _Encoder(config, tp, eps)
        self.sep_token_id: int | None = None  # set by model_exec/pooling_model.py from the tokenizer
        self.position_offset = int(config.hf.get("pad_token_id", 1)) + 1 if self.positions_after_padding_idx else 0

    def checkpoint_param(self, ckpt_name: str) -> tuple[str, ShardId] | None:
        for prefix in _BASE_PREFIXES:
            if ckpt_name.startswith(prefix):
                ckpt_name = ckpt_name.removeprefix(prefix)
                break
        if ckpt_name.startswith(self.skipped_prefixes) or ckpt_name.endswith(("position_ids", "token_type_ids")):
            return None  # position_ids / token_type_ids: buffers some checkpoints save
        return super().checkpoint_param(ckpt_name)

    def _token_types(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """0 up to and including each row's first [SEP], 1 after it (BERT pairs); all 0 with one type."""
        if self.embeddings.type_vocab_size < 2 or self.sep_token_id is None:
            return torch.zeros_like(input_ids)
        seps = (input_ids == self.sep_token_id).long().cumsum(0)
        starts = meta.query_start_loc.long()
        lengths = starts[1:] - starts[:-1]
        before_row = torch.cat([seps.new_zeros(1), seps])[starts[:-1]]  # seps counted before each row
        seps_before_token = seps - (input_ids == self.sep_token_id).long() - before_row.repeat_interleave(lengths)
        return (seps_before_token > 0).long()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        del kv_caches
        emb = self.embeddings
        hidden = (
            emb.word_embeddings(input_ids)
            + emb.position_embeddings(positions + self.position_offset)
            + emb.token_type_embeddings(self._token_types(input_ids, meta))
        )
        hidden = emb.LayerNorm(hidden)
        bounds = sequence_bounds(meta.query_start_loc)
        for layer in self.encoder.layer:
            hidden = layer(hidden, bounds)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise ValueError(f"{self.config.architecture} is a pooling model: it has no language-model head")


class XLMRobertaModel(BertModel):
    positions_after_padding_idx: ClassVar[bool] = True


class _BertPooler(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=config.torch_dtype)


class BertForSequenceClassification(BertModel):
    """Cross-encoder: classifier(tanh(pooler(first token)))."""

    skipped_prefixes: ClassVar[tuple[str, ...]] = ("lm_head.", "cls.")

    def __init__(self, config: ModelConfig, tp: TPGroup, attn_backend: type[AttentionBackend]) -> None:
        super().__init__(config, tp, attn_backend)
        self.pooler = _BertPooler(config)
        self.classifier = nn.Linear(config.hidden_size, num_labels(config.hf), dtype=config.torch_dtype)

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(first_token_hidden)))


class _RobertaClassificationHead(nn.Module):
    def __init__(self, config: ModelConfig, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=config.torch_dtype)
        self.out_proj = nn.Linear(config.hidden_size, labels, dtype=config.torch_dtype)


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """Cross-encoder (bge-reranker): out_proj(tanh(dense(first token)))."""

    def __init__(self, config: ModelConfig, tp: TPGroup, attn_backend: type[AttentionBackend]) -> None:
        super().__init__(config, tp, attn_backend)
        self.classifier = _RobertaClassificationHead(config, num_labels(config.hf))

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(first_token_hidden)))
