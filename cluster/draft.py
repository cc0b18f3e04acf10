"""The draft model of speculative decoding, read and checked against the target before any worker starts.

`{"method": "draft_model", "model": PATH, ...}`: the draft must share the target's vocabulary (its logits
index the same token ids, and its tokens are fed to the target as they are) and hold the target's whole
context (it runs every position the target runs). A draft that does not is refused here, by name, for the
engine and for `raytp serve`'s check before Ray starts (`read_checked_model`).
"""

from __future__ import annotations

from cluster.config import EngineConfig
from model_exec.config import ModelConfig
from model_exec.shard_config import DraftSpec
from model_exec.source import ModelSource, load_tokenizer, read_model_config, resolve_model


def read_draft(config: EngineConfig, target: ModelSource, model_config: ModelConfig) -> DraftSpec | None:
    """The draft model's spec; None when the engine speculates without one (or not at all)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None  # SpeculativeConfig requires it for this method
    try:
        source = resolve_model(spec.model)
        draft = read_model_config(source, config.trust_remote_code)
    except ValueError as e:
        raise ValueError(f"speculative_config: the draft model cannot be read: {e}") from None
    if draft.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {source.name!r} has another vocabulary ({draft.vocab_size} "
            f"tokens; the target {model_config.vocab_size}): a draft must share the target's tokenizer."
        )
    if load_tokenizer(source).get_vocab() != load_tokenizer(target).get_vocab():
        raise ValueError(
            f"speculative_config: the draft model {source.name!r} has another vocabulary (its tokenizer maps "
            "tokens to other ids than the target's): a draft must share the target's tokenizer."
        )
    context = config.max_model_len or model_config.max_context_len
    if draft.max_context_len < context:
        raise ValueError(
            f"speculative_config: the draft model {source.name!r} holds {draft.max_context_len} tokens of context, "
            f"fewer than the target's max_model_len ({context}); set a smaller max_model_len."
        )
    return DraftSpec(model=spec.model, model_config=draft)
