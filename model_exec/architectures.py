"""The one registry of model architectures, torch-free: the controller refuses an unsupported model before
any worker starts (`model_exec.config`), and the workers build the class it names (`model_exec.models`).

Every decoder family is built by the one decoder (`model_exec/models/decoder.py`) from its row's
`DecoderSpec`: how the family differs from Llama. A new family that fits the spec is one row here; a
family with code of its own (a MoE block) adds that code in a file under `model_exec/models/` and names it
from the spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class DecoderSpec:
    """A family's decoder quirks, each as HF's code for that family does it. The defaults are Llama's.

    Values that vary per checkpoint (a soft-cap, a scale) are named by their config.json field and read
    from `ModelConfig.hf` when the model is built (`model_exec/models/options.py` checks them).
    """

    gemma_norm: bool = False  # every RMSNorm is Gemma's: x / rms(x) * (1 + weight), all in float32
    # a norm on the attention output and one on the MLP output before each joins the residual, the MLP's
    # input norm named pre_feedforward_layernorm (Gemma 2/3); else Llama's two norms per layer
    sandwich_norms: bool = False
    qk_norm: bool = False  # per-head RMSNorm (of the family's kind) on q and k before the rotation
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), that factor rounded to the model dtype
    # config.json field s whose s ** -0.5 scales attention (Gemma's query_pre_attn_scalar, required when
    # named); None: head_dim ** -0.5
    attn_scale_key: str | None = None
    attn_soft_cap_key: str | None = None  # field of the attention scores' soft-cap (null: none)
    final_soft_cap_key: str | None = None  # field of the LM head logits' soft-cap (null: none)
    # rope per layer type ("full_attention" / "sliding_attention", from `layer_types` or
    # `sliding_window_pattern`): per-type `rope_parameters`, or in older config.json forms the global layers'
    # rope_theta/rope_scaling and this field's theta for the sliding ones (Gemma 3: rope_local_base_freq).
    # None: one rope for every layer.
    local_rope_theta_key: str | None = None
    # config.json fields that turn on the q/k/v projections' biases and the output projection's (None: never)
    qkv_bias_key: str = "attention_bias"
    o_bias_key: str | None = "attention_bias"
    # "module:function" building layer i's MLP, (config, tp, i) -> module or None for the dense gated MLP
    # (the MoE families); None: every layer's MLP is the gated MLP of `hidden_act`
    mlp: str | None = None
    # checkpoint naming: layers stored fused (Phi-3's qkv_proj, gate_up_proj; the others are stacked from
    # q/k/v and gate/up), and substrings renamed before mapping (Mixtral's block_sparse_moe -> mlp)
    fused_checkpoint_modules: tuple[str, ...] = ()
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # config.json fields the implementation refuses when set (truthy), each with the reason
    refused: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Architecture:
    model_type: str  # the HF config's `model_type`: names the architecture when a config has no `architectures`
    module: str = "model_exec.models.decoder"  # where the class lives (imported lazily, in the workers only)
    class_name: str = "CausalDecoder"
    gguf_arch: str | None = None  # GGUF `general.architecture` that loads into it (None: safetensors only)
    notes: str = ""  # one line for README's table of models: the family's quirks raytp implements
    # HF's config-class defaults for fields a config.json may omit (older checkpoints write fewer), where
    # they differ from what `ModelConfig` assumes or are read by the model from `ModelConfig.hf`;
    # applied under config.json's own values. `sliding_window_pattern` n (without `layer_types`): every
    # n-th layer attends in full, the others slide, as HF's Gemma 2/3 configs build `layer_types`.
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    decoder: DecoderSpec = DecoderSpec()  # what the decoder class builds (other classes ignore it)
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


_GEMMA_REFUSED = (("use_bidirectional_attention", "the bidirectional (embedding) variant is not supported"),)
_GEMMA2 = DecoderSpec(
    gemma_norm=True,
    sandwich_norms=True,
    embed_scale=True,
    attn_scale_key="query_pre_attn_scalar",
    attn_soft_cap_key="attn_logit_softcapping",
    final_soft_cap_key="final_logit_softcapping",
    refused=_GEMMA_REFUSED,
)
# Gemma 3: Gemma 2 with q/k norms and rope per layer type, without attention soft-capping
_GEMMA3 = replace(
    _GEMMA2,
    qk_norm=True,
    attn_soft_cap_key=None,
    local_rope_theta_key="rope_local_base_freq",
    refused=(
        *_GEMMA_REFUSED,
        (
            "attn_logit_softcapping",
            "but Hugging Face's Gemma 3 never applies it; refusing rather than computing something else than the "
            "reference",
        ),
    ),
)
# Qwen2's attention: q/k/v biases (Qwen2-MoE's `qkv_bias`, default on), none on the output
_QWEN2_BIASES: Mapping[str, Any] = {"qkv_bias": True}

# HF `architectures[0]` -> the implementation
ARCHITECTURES: Mapping[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", gguf_arch="llama", notes="Llama 2/3.x, SmolLM2; rope scaling"),
    "MistralForCausalLM": Architecture("mistral", gguf_arch="llama", notes="sliding-window attention"),
    "Qwen2ForCausalLM": Architecture(
        "qwen2",
        gguf_arch="qwen2",
        notes="q/k/v biases; per-layer windows",
        config_defaults=_QWEN2_BIASES,
        decoder=DecoderSpec(qkv_bias_key="qkv_bias", o_bias_key=None),
    ),
    "Gemma2ForCausalLM": Architecture(
        "gemma2",
        gguf_arch="gemma2",
        notes="sandwich norms, attention and final logit soft-capping, alternating local/global layers",
        config_defaults=_GEMMA2_DEFAULTS,
        decoder=_GEMMA2,
    ),
    "Gemma3ForCausalLM": Architecture(
        "gemma3_text",
        gguf_arch="gemma3",
        notes="text only; q/k norms, 5 local : 1 global layers, per-layer-type rope",
        config_defaults=_GEMMA3_DEFAULTS,
        decoder=_GEMMA3,
    ),
    # GGUF: llama.cpp writes Mixtral as a `llama` file with experts (model_exec/gguf_metadata.py tells them
    # apart); the MoE files' stacked experts split into per-expert tensors on load
    "MixtralForCausalLM": Architecture(
        "mixtral",
        gguf_arch="llama",
        notes="sparse MoE, top-k renormalised; experts sharded over TP",
        decoder=DecoderSpec(
            mlp="model_exec.models.moe_blocks:mixtral_moe",
            checkpoint_renames=((".block_sparse_moe.", ".mlp."),),
        ),
    ),
    "Qwen2MoeForCausalLM": Architecture(
        "qwen2_moe",
        gguf_arch="qwen2moe",
        notes="sparse MoE + sigmoid-gated shared expert; q/k/v biases; mlp_only_layers",
        config_defaults=_QWEN2_BIASES,
        decoder=DecoderSpec(qkv_bias_key="qkv_bias", o_bias_key=None, mlp="model_exec.models.moe_blocks:qwen2_moe"),
    ),
    "Qwen3MoeForCausalLM": Architecture(
        "qwen3_moe",
        gguf_arch="qwen3moe",
        notes="sparse MoE (norm_topk_prob); per-head q/k RMSNorm",
        decoder=DecoderSpec(qk_norm=True, mlp="model_exec.models.moe_blocks:qwen3_moe"),
    ),
    "Qwen3ForCausalLM": Architecture(
        "qwen3",
        gguf_arch="qwen3",
        notes="per-head q/k RMSNorm; head_dim apart from hidden size; attention_bias; rope scaling",
        decoder=DecoderSpec(qk_norm=True),
    ),
    "Phi3ForCausalLM": Architecture(
        "phi3",
        gguf_arch="phi3",
        notes="Phi-3, Phi-4: fused qkv/gate_up checkpoints; partial rotary; longrope; sliding window",
        decoder=DecoderSpec(fused_checkpoint_modules=("qkv_proj", "gate_up_proj")),
    ),
}


def _encoder(model_type: str, class_name: str, task: str, notes: str) -> Architecture:
    return Architecture(model_type, "model_exec.models.bert", class_name, None, notes, _ENCODER_DEFAULTS,
                        task=task, default_pooling="CLS")  # fmt: skip


def _base_model(causal: str, class_name: str, notes: str) -> Architecture:
    """A decoder saved as its base model (embedding checkpoints): the causal row's spec, no LM head."""
    return replace(ARCHITECTURES[causal], module="model_exec.models.decoder_embedder", class_name=class_name,
                   gguf_arch=None, notes=notes, task="embed")  # fmt: skip


# Pooling models (runner="pooling"; model_exec/models/bert.py, model_exec/models/decoder_embedder.py)
ARCHITECTURES = {
    **ARCHITECTURES,
    "BertModel": _encoder(
        "bert", "BertModel", "embed", "embeddings; bidirectional attention; pooling from sentence-transformers' files"
    ),
    "XLMRobertaModel": _encoder(
        "xlm-roberta", "XLMRobertaModel", "embed",
        "embeddings (bge-m3, e5); bidirectional attention; positions from padding_idx + 1",
    ),
    "BertForSequenceClassification": _encoder(
        "bert", "BertForSequenceClassification", "score",
        "cross-encoder scores (/v1/score, /v1/rerank): pooler + classifier",
    ),
    "XLMRobertaForSequenceClassification": _encoder(
        "xlm-roberta", "XLMRobertaForSequenceClassification", "score",
        "cross-encoder scores (bge-reranker): classification head on the first token",
    ),
    "LlamaModel": _base_model("LlamaForCausalLM", "LlamaModel", "embeddings, last token"),
    "Qwen2Model": _base_model("Qwen2ForCausalLM", "Qwen2Model", "embeddings (gte-Qwen2), last token"),
    "Qwen3Model": _base_model("Qwen3ForCausalLM", "Qwen3Model", "embeddings (Qwen3-Embedding), last token"),
    # a decoder reranker (model_exec/models/decoder_classifier.py): a stored score head, or Qwen3-Reranker's
    # yes/no LM head rows through vLLM's hf_overrides
    "Qwen3ForSequenceClassification": replace(
        _base_model("Qwen3ForCausalLM", "Qwen3ForSequenceClassification",
                    "scores (Qwen3-Reranker: yes/no logits via hf_overrides, as vLLM), last token"),
        module="model_exec.models.decoder_classifier", task="score",
    ),
}  # fmt: skip
# model_type -> architecture, for configs that carry no `architectures` (e.g. those parsed from GGUF);
# generation architectures first: a GGUF `llama` is a LlamaForCausalLM, never a LlamaModel
ARCHITECTURE_BY_MODEL_TYPE: Mapping[str, str] = {
    a.model_type: name for name, a in reversed(list(ARCHITECTURES.items())) if a.task in ("generate", "embed")
}
