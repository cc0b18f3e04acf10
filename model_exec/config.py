"""The model's shape, as our layers need it, normalised from a Hugging Face config.

Torch-free on purpose: the controller reads `ModelConfig` (TP check, EOS ids,
context length) without loading any tensor library.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from model_exec.architectures import ARCHITECTURE_BY_MODEL_TYPE, ARCHITECTURES

if TYPE_CHECKING:
    import torch

# rope type -> keys that type requires in `rope_scaling`
ROPE_SCALING_KEYS: Mapping[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
}
# older names of rope types, as transformers reads them (Phi-3's first configs say "su")
_ROPE_TYPE_ALIASES: Mapping[str, str] = {"su": "longrope"}
# types whose parameters name the pretraining context; HF fills it in (config.original_max_position_embeddings
# first, Phi-3 keeps it there, else max_position_embeddings) when the rope parameters lack it
_ROPE_TYPES_WITH_ORIGINAL_MAX = ("llama3", "yarn", "longrope")
_DTYPES = ("float32", "float16", "bfloat16")
# activations model_exec.layers.activation implements (HF's names; its ACT_AND_MUL has one class each)
# gelu (erf): the encoders' feed-forward (model_exec/models/bert.py), which is not gated
HIDDEN_ACTS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class ModelConfig:
    """What every decoder-only family shares, and what the controller needs (torch-free).

    What only some families have (Gemma's soft-capping, a MoE's experts, Qwen3's q/k norms) is in the
    family's registry row (`architectures.DecoderSpec`), its values read from `hf`, the checkpoint's
    config.json as read; this class does not grow a flag per family.
    """

    architecture: str  # HF `architectures[0]`; picks the model class from the registry
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else {"rope_type": ..., <that type's parameters>}, never containing rope_theta
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q, k, v projections (Qwen2; Llama's attention_bias)
    o_bias: bool  # bias on the output projection (Llama's attention_bias only)
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # parameter dtype name ("float32", "float16", "bfloat16"); from_hf_config takes the checkpoint's,
    # the engine may replace() it with the dtype the user asked for
    dtype: str = "float32"
    # per layer: its sliding-window size (ops/attention/base.py gives the semantics), None for full
    # attention; () means every layer is full (e.g. configs built by hand in tests)
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    # fraction of each head's features that rope rotates (HF's partial_rotary_factor; Phi-3-mini 1.0, Phi-4-mini
    # 0.75); the rest pass through unrotated
    partial_rotary_factor: float = 1.0
    # the checkpoint's config.json as read, for the per-family fields each model file parses itself
    hf: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # what `model_exec.models` implements (model_exec/architectures.py), read live from the registry;
        # checked here, torch-free, so the controller refuses an unsupported model before any worker starts
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"model architecture {self.architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; implemented: {', '.join(HIDDEN_ACTS)}")
        if self.layer_windows and len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_hidden_layers} layers")
        if any(w is not None and (not isinstance(w, int) or w < 1) for w in self.layer_windows):
            raise ValueError(f"sliding windows must be positive integers, got {self.layer_windows!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {_DTYPES}")
        if self.rope_scaling is not None:
            rope_type = str(self.rope_scaling.get("rope_type"))
            if rope_type not in ROPE_SCALING_KEYS or rope_type == "default":
                raise ValueError(
                    f"unsupported rope_scaling type {rope_type!r}; supported: "
                    f"{sorted(t for t in ROPE_SCALING_KEYS if t != 'default')} (or none)"
                )
            missing = [k for k in ROPE_SCALING_KEYS[rope_type] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling of type {rope_type!r} is missing {missing}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives rotary dimension {self.rotary_dim} of "
                f"head_dim {self.head_dim}; it must be a positive even number of features"
            )
        if not all(isinstance(t, int) for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be integers, got {self.eos_token_ids!r}")

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def sliding_window(self) -> int | None:
        """The largest window of any windowed layer (None if every layer attends in full)."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model runs: max_position_embeddings, times `factor` under dynamic NTK
        rope, whose base rescales for exactly the lengths past it (vLLM's limit; HF sets none)."""
        if self.rope_scaling is not None and self.rope_type == "dynamic":
            return int(self.max_position_embeddings * float(self.rope_scaling["factor"]))
        return self.max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        """How many features of each head rope rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError unless `tp_size` ranks can split the attention heads evenly."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
        heads = {
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
        }
        bad = [f"{name}={n}" for name, n in heads.items() if n % tp_size != 0]
        if bad:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must divide num_attention_heads={self.num_attention_heads} "
                f"and num_key_value_heads={self.num_key_value_heads}; it does not divide {' or '.join(bad)}"
            )

    @classmethod
    def from_hf_config(cls, hf_config: Any, extra_eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Build from a `transformers` PretrainedConfig (v4 `rope_scaling` or v5 `rope_parameters`).

        `extra_eos_token_ids` come from generation_config.json (instruct models often list several).
        """
        model_type = getattr(hf_config, "model_type", None)
        archs = getattr(hf_config, "architectures", None) or []
        architecture = archs[0] if archs else ARCHITECTURE_BY_MODEL_TYPE.get(str(model_type))
        if architecture is None:
            raise ValueError(f"cannot tell the architecture of {model_type!r}: config lacks `architectures`")
        row = ARCHITECTURES.get(architecture)
        defaults = row.config_defaults if row is not None else {}
        # which config.json fields turn the attention biases on is the family's (its registry row)
        qkv_bias_key = row.decoder.qkv_bias_key if row is not None else "attention_bias"
        o_bias_key = row.decoder.o_bias_key if row is not None else "attention_bias"
        if not hasattr(hf_config, "to_dict"):
            # a config.json as read: fill in what HF's config class would (a PretrainedConfig already has it)
            hf_config = SimpleNamespace(**{**defaults, **vars(hf_config)})
        hidden_size = hf_config.hidden_size
        num_heads = hf_config.num_attention_heads
        max_pos = hf_config.max_position_embeddings
        rope_theta, rope_scaling, partial_rotary_factor = _normalise_rope(hf_config, max_pos)
        eos = _as_id_tuple(getattr(hf_config, "eos_token_id", None)) + tuple(extra_eos_token_ids)
        num_layers = hf_config.num_hidden_layers
        # Gemma's models read `hidden_activation` (their config.json may also carry a `hidden_act`)
        hidden_act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None) or "silu"
        return cls(
            architecture=architecture,
            vocab_size=hf_config.vocab_size,
            hidden_size=hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hidden_size // num_heads,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf_config, qkv_bias_key, defaults.get(qkv_bias_key, False))),
            o_bias=o_bias_key is not None and bool(getattr(hf_config, o_bias_key, defaults.get(o_bias_key, False))),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            dtype=_dtype_name(hf_config),
            layer_windows=_layer_windows(hf_config, num_layers),
            hidden_act=hidden_act,
            partial_rotary_factor=partial_rotary_factor,
            hf=dict(vars(hf_config)) if not hasattr(hf_config, "to_dict") else {**defaults, **hf_config.to_dict()},
        )


def hf_int(hf: Mapping[str, Any], *names: str) -> int:
    """A per-family field of config.json (`ModelConfig.hf`): the first of `names` it sets (aliases across
    transformers versions), as a positive integer; ValueError naming the field otherwise."""
    for name in names:
        value = hf.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
            return value
    raise ValueError(f"config.json: {' or '.join(names)} is required for {hf.get('model_type', 'this model')!r}")


def _layer_windows(hf_config: Any, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows from `layer_types` (transformers writes it for Gemma 2/3, Qwen2/3 and others),
    else from `sliding_window_pattern` n as HF's Gemma configs build `layer_types` (layer i is full iff
    (i + 1) % n == 0), else the one `sliding_window` for every layer (Mistral, Mixtral, Phi-3).
    Qwen-style configs window only with `use_sliding_window` (their `layer_types` already says which)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return ()
    layer_types = hf_layer_types(
        getattr(hf_config, "layer_types", None), getattr(hf_config, "sliding_window_pattern", None), num_layers
    )
    if layer_types is None:  # older Qwen2 configs window only the layers from max_window_layers on
        first = int(getattr(hf_config, "max_window_layers", 0) or 0) if hasattr(hf_config, "use_sliding_window") else 0
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    if len(layer_types) != num_layers:
        raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for {num_layers} layers")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return windows if any(w is not None for w in windows) else ()


def hf_layer_types(layer_types: Any, sliding_window_pattern: Any, num_layers: int) -> list[str] | None:
    """config.json's `layer_types`, else the one HF's Gemma configs build from `sliding_window_pattern` n
    (layer i is "full_attention" iff (i + 1) % n == 0, the others "sliding_attention"), else None."""
    if layer_types is not None or sliding_window_pattern is None:
        return layer_types
    n = sliding_window_pattern
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"config.json: sliding_window_pattern must be a positive integer, got {n!r}")
    return ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(num_layers)]


def _normalise_rope(hf_config: Any, max_pos: int) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from either transformers-5 `rope_parameters` or
    older fields, filled in as transformers' `standardize_rope_params` does."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, Mapping) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if not isinstance(params, Mapping):
        params = getattr(hf_config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    scaling["rope_type"] = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if scaling["rope_type"] == "default":
        return float(theta), None, partial
    if scaling["rope_type"] in _ROPE_TYPES_WITH_ORIGINAL_MAX:
        top_level = getattr(hf_config, "original_max_position_embeddings", None)
        if top_level is not None:  # HF gives the top-level field priority (Phi-3 keeps it there)
            scaling["original_max_position_embeddings"] = int(top_level)
        scaling.setdefault("original_max_position_embeddings", max_pos)
    return float(theta), scaling, partial


def _as_id_tuple(ids: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, int):
        return (ids,)
    return tuple(int(i) for i in ids)


def _dtype_name(hf_config: Any) -> str:
    dtype = getattr(hf_config, "dtype", None)
    if dtype is None:
        dtype = vars(hf_config).get("torch_dtype")  # transformers < 5; read raw: no deprecation warning
    if dtype is None:
        return "float32"  # e.g. configs parsed from GGUF: weights are dequantised to float32
    name = str(dtype).removeprefix("torch.")
    return name if name in _DTYPES else "float32"
