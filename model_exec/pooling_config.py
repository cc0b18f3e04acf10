"""How a pooling model turns hidden states into its answer, read from the model's own files (torch-free).

Order of authority, as vLLM: the `pooler_config` the user gives (vLLM's field names: `pooling_type`
MEAN / CLS / LAST, `normalize`), over the folder's sentence-transformers files (`modules.json` naming a
`Pooling` module whose `config.json` says mean, cls or lasttoken, and a `Normalize` module), over the
architecture's default (`Architecture.default_pooling`: last token for decoders). Cross-encoders
(task "score") pool the first token (encoders) or the last (decoders) into their classification head; the
activation on its logits is what sentence-transformers' CrossEncoder applies: the one its config names, else
sigmoid for one label (vLLM's too).

Decision: modules sentence-transformers would apply that raytp does not implement (Dense, LayerNorm,
a pooling mode such as max or weightedmean) are refused by name when the engine starts, never skipped:
skipping one would return vectors that differ from the model's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_exec.architectures import ARCHITECTURES

POOLING_TYPES: tuple[str, ...] = ("MEAN", "CLS", "LAST")
# sentence-transformers' Pooling modes -> vLLM's pooling types
_ST_MODES: Mapping[str, str] = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST"}
_ST_LEGACY_KEYS: Mapping[str, str] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_MODULE_KINDS = ("Transformer", "Pooling", "Normalize")
_ACTIVATIONS: Mapping[str, str] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


@dataclass(frozen=True)
class PoolerConfig:
    task: str  # "embed" | "score" (the architecture's; decoders embed)
    pooling_type: str  # MEAN | CLS | LAST: which hidden states make the vector
    normalize: bool  # L2-normalize embeddings (sentence-transformers' Normalize module)
    activation: str = "identity"  # score models: "sigmoid" | "identity" on the classifier's logits
    source: str = ""  # where the settings came from, for the start-up log line

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.activation not in ("sigmoid", "identity"):
            raise ValueError(f"unsupported classifier activation {self.activation!r}")


def pooling_task(architecture: str) -> str:
    """ "generate" for decoders (which may also embed), "embed" or "score" for pooling-only architectures."""
    return ARCHITECTURES[architecture].task


def resolve_pooler_config(
    model_dir: str, architecture: str, hf: Mapping[str, Any], override: Mapping[str, Any] | None = None
) -> PoolerConfig:
    """The pooling a model's files ask for, with the user's `pooler_config` on top; ValueError names what
    raytp cannot apply."""
    arch = ARCHITECTURES[architecture]
    task = "embed" if arch.task == "generate" else arch.task
    pooling_type, normalize, source = arch.default_pooling, False, f"{architecture}'s default"
    st = _read_sentence_transformers(Path(model_dir))
    if st is not None:
        pooling_type, normalize = st
        source = "sentence-transformers modules.json"
    activation = "identity"
    if task == "score":
        # the classification head reads the first token (encoders) or the last (decoder classifiers)
        pooling_type, normalize = arch.default_pooling, False
        activation = _cross_encoder_activation(hf)
    if override:
        unknown = set(override) - {"pooling_type", "normalize", "activation"}
        if unknown:
            raise ValueError(
                f"pooler_config: unsupported field(s) {sorted(unknown)} "
                "(supported: pooling_type, normalize, activation)"
            )
        pooling_type = str(override.get("pooling_type", pooling_type)).upper()
        normalize = bool(override.get("normalize", normalize))
        activation = str(override.get("activation", activation))
        source += " + pooler_config"
    return PoolerConfig(task, pooling_type, normalize, activation, source)


def _read_sentence_transformers(folder: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers folder; None when it is not one."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type: str | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_MODULE_KINDS:
            raise ValueError(f"modules.json: sentence-transformers module {module.get('type')!r} is not supported")
        if kind == "Pooling":
            pooling_type = _pooling_mode(folder / module.get("path", ""), module.get("type"))
        elif kind == "Normalize":
            normalize = True
    if pooling_type is None:
        raise ValueError("modules.json names no Pooling module: raytp cannot tell how to pool")
    return pooling_type, normalize


def _pooling_mode(path: Path, kind: Any) -> str:
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("include_prompt", True) is False:
        raise ValueError(f"{path}/config.json: include_prompt=false (instruction-excluding pooling) is not supported")
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [m for key, m in _ST_LEGACY_KEYS.items() if cfg.get(key)]
        mode = modes if len(modes) != 1 else modes[0]
        if not modes:
            mode = "mean"  # sentence-transformers' default
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ValueError(f"{path}/config.json: pooling mode {mode!r} is not supported (mean, cls, lasttoken are)")
    return _ST_MODES[mode]


def _cross_encoder_activation(hf: Mapping[str, Any]) -> str:
    """What CrossEncoder.predict applies: the activation its config names, else sigmoid for one label."""
    st = hf.get("sentence_transformers")
    named = st.get("activation_fn") if isinstance(st, Mapping) else None
    if named is not None:
        if named not in _ACTIVATIONS:
            raise ValueError(f"config.json: cross-encoder activation {named!r} is not supported")
        return _ACTIVATIONS[named]
    return "sigmoid" if num_labels(hf) == 1 else "identity"


# vLLM's ways to make a decoder's classifier from its LM head rows of `classifier_from_token` (hf_overrides):
# the two tokens [false, true] as one label W[true] - W[false] (sigmoid of it = softmax over the pair's logits),
# or each token's row as a label of its own
CLASSIFIER_METHODS: tuple[str, ...] = ("from_2_way_softmax", "no_post_processing")


def classifier_from_tokens(hf: Mapping[str, Any]) -> tuple[list[str], str] | None:
    """(tokens, method) when the classifier is made from LM head rows (vLLM's `classifier_from_token`, with
    `method`, or `is_original_qwen3_reranker: true` for from_2_way_softmax); None for a stored head."""
    tokens = hf.get("classifier_from_token")
    original_qwen3 = bool(hf.get("is_original_qwen3_reranker"))
    if tokens is None:
        if original_qwen3:
            raise ValueError('is_original_qwen3_reranker needs classifier_from_token: ["no", "yes"]')
        return None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}")
    method = "from_2_way_softmax" if original_qwen3 else hf.get("method")
    if method not in CLASSIFIER_METHODS:
        raise ValueError(
            f"classifier_from_token needs method {' or '.join(CLASSIFIER_METHODS)} (or is_original_qwen3_reranker: "
            f"true), got {method!r}"
        )
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"from_2_way_softmax takes two tokens [false, true], got {tokens!r}")
    return tokens, method


def num_labels(hf: Mapping[str, Any]) -> int:
    """A classification head's outputs (a head from tokens: one per token, one for a 2-way softmax; HF:
    id2label's size, else num_labels, else 2)."""
    from_tokens = classifier_from_tokens(hf)
    if from_tokens is not None:
        tokens, method = from_tokens
        return 1 if method == "from_2_way_softmax" else len(tokens)
    id2label = hf.get("id2label")
    if isinstance(id2label, Mapping) and id2label:
        return len(id2label)
    return int(hf.get("num_labels", 2))


def pooling_max_len(architecture: str, hf: Mapping[str, Any], max_position_embeddings: int) -> int:
    """Longest input an encoder's position table takes: XLM-R's positions start at padding_idx + 1."""
    if architecture.startswith("XLMRoberta"):
        return max_position_embeddings - int(hf.get("pad_token_id", 1)) - 1  # as models/bert.py indexes
    return max_position_embeddings
