"""The one registry of model architectures, torch-free: the controller refuses an unsupported model before
any worker starts (`model_exec.config`), and the workers build the class it names (`model_exec.models`).

A model family is one file under `model_exec/models/` and one row here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Architecture:
    model_type: str  # the HF config's `model_type`: names the architecture when a config has no `architectures`
    module: str  # where the class lives (imported lazily, in the workers only)
    class_name: str
    gguf_arch: str | None = None  # GGUF `general.architecture` that loads into it (None: safetensors only)
    notes: str = ""  # one line for README's table of models: the family's quirks raytp implements
    # HF's config-class defaults for fields a config.json may omit (older checkpoints write fewer), where
    # they differ from what `ModelConfig` assumes or are read by the model file from `ModelConfig.hf`;
    # applied under config.json's own values. `sliding_window_pattern` n (without `layer_types`): every
    # n-th layer attends in full, the others slide, as HF's Gemma 2/3 configs build `layer_types`.
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    # what the architecture serves: "generate" (a decoder: it can also embed, runner="pooling", last-token
    # pooling over its final hidden states) or "embed" / "score" (pooling only: encoders, cross-encoders)
    task: str = "generate"
    # pooling models: the pooling sentence-transformers would apply when the folder has no modules.json
    default_pooling: str = "LAST"


# Fields BERT-style encoders' config.json has no use for in ModelConfig's decoder terms (no RMSNorm, no
# rope): their model file reads layer_norm_eps and type_vocab_size from `ModelConfig.hf` instead.
_ENCODER_DEFAULTS: Mapping[str, Any] = {"rms_norm_eps": 1e-12, "hidden_act": "gelu", "tie_word_embeddings": False}


# HF's Gemma2Config defaults (transformers 5.24)
_GEMMA2_DEFAULTS: Mapping[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 2,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
# HF's Gemma3TextConfig defaults: no soft-capping, every 6th layer global, global/local rope bases 1e6/1e4
_GEMMA3_DEFAULTS: Mapping[str, Any] = {
    **_GEMMA2_DEFAULTS,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}


# HF `architectures[0]` -> the implementation
ARCHITECTURES: Mapping[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        "llama", "model_exec.models.llama", "LlamaForCausalLM", "llama", "Llama 2/3.x, SmolLM2; rope scaling"
    ),
    "MistralForCausalLM": Architecture(
        "mistral", "model_exec.models.llama", "LlamaForCausalLM", "llama", "sliding-window attention"
    ),
    "Qwen2ForCausalLM": Architecture(
        "qwen2", "model_exec.models.llama", "LlamaForCausalLM", "qwen2", "q/k/v biases; per-layer windows"
    ),
    "Gemma2ForCausalLM": Architecture(
        "gemma2",
        "model_exec.models.gemma2",
        "Gemma2ForCausalLM",
        "gemma2",
        "sandwich norms, attention and final logit soft-capping, alternating local/global layers",
        _GEMMA2_DEFAULTS,
    ),
    "Gemma3ForCausalLM": Architecture(
        "gemma3_text",
        "model_exec.models.gemma3",
        "Gemma3ForCausalLM",
        "gemma3",
        "text only; q/k norms, 5 local : 1 global layers, per-layer-type rope",
        _GEMMA3_DEFAULTS,
    ),
    # GGUF: llama.cpp writes Mixtral as a `llama` file with experts (model_exec/gguf_metadata.py tells them
    # apart); the MoE files' stacked experts split into per-expert tensors on load
    "MixtralForCausalLM": Architecture(
        "mixtral", "model_exec.models.mixtral", "MixtralForCausalLM", "llama",
        "sparse MoE, top-k renormalised; experts sharded over TP",
    ),
    "Qwen2MoeForCausalLM": Architecture(
        "qwen2_moe", "model_exec.models.qwen_moe", "Qwen2MoeForCausalLM", "qwen2moe",
        "sparse MoE + sigmoid-gated shared expert; q/k/v biases; mlp_only_layers",
    ),
    "Qwen3MoeForCausalLM": Architecture(
        "qwen3_moe", "model_exec.models.qwen_moe", "Qwen3MoeForCausalLM", "qwen3moe",
        "sparse MoE (norm_topk_prob); per-head q/k RMSNorm",
    ),
    "Qwen3ForCausalLM": Architecture(
        "qwen3",
        "model_exec.models.qwen3",
        "Qwen3ForCausalLM",
        "qwen3",
        "per-head q/k RMSNorm; head_dim apart from hidden size; attention_bias; rope scaling",
    ),
    "Phi3ForCausalLM": Architecture(
        "phi3",
        "model_exec.models.phi3",
        "Phi3ForCausalLM",
        "phi3",
        "Phi-3, Phi-4: fused qkv/gate_up checkpoints; partial rotary; longrope; sliding window",
    ),
    # Pooling models (runner="pooling"; model_exec/models/bert.py, model_exec/models/decoder_embedder.py)
    "BertModel": Architecture(
        "bert", "model_exec.models.bert", "BertModel", None,
        "embeddings; bidirectional attention; pooling from sentence-transformers' files",
        _ENCODER_DEFAULTS, task="embed", default_pooling="CLS",
    ),
    "XLMRobertaModel": Architecture(
        "xlm-roberta", "model_exec.models.bert", "XLMRobertaModel", None,
        "embeddings (bge-m3, e5); bidirectional attention; positions from padding_idx + 1",
        _ENCODER_DEFAULTS, task="embed", default_pooling="CLS",
    ),
    "BertForSequenceClassification": Architecture(
        "bert", "model_exec.models.bert", "BertForSequenceClassification", None,
        "cross-encoder scores (/v1/score, /v1/rerank): pooler + classifier",
        _ENCODER_DEFAULTS, task="score", default_pooling="CLS",
    ),
    "XLMRobertaForSequenceClassification": Architecture(
        "xlm-roberta", "model_exec.models.bert", "XLMRobertaForSequenceClassification", None,
        "cross-encoder scores (bge-reranker): classification head on the first token",
        _ENCODER_DEFAULTS, task="score", default_pooling="CLS",
    ),
    # decoders saved as sentence-transformers folders (base model only, no LM head), last-token pooling
    "LlamaModel": Architecture(
        "llama", "model_exec.models.decoder_embedder", "LlamaModel", None, "embeddings, last token",
        task="embed",
    ),
    "Qwen2Model": Architecture(
        "qwen2", "model_exec.models.decoder_embedder", "Qwen2Model", None, "embeddings (gte-Qwen2), last token",
        task="embed",
    ),
    "Qwen3Model": Architecture(
        "qwen3", "model_exec.models.decoder_embedder", "Qwen3Model", None, "embeddings (Qwen3-Embedding), last token",
        task="embed",
    ),
}
# model_type -> architecture, for configs that carry no `architectures` (e.g. those parsed from GGUF)
# (generation architectures first: a GGUF `llama` is a LlamaForCausalLM, never a LlamaModel)
ARCHITECTURE_BY_MODEL_TYPE: Mapping[str, str] = {
    a.model_type: name for name, a in reversed(list(ARCHITECTURES.items())) if a.task in ("generate", "embed")
}
