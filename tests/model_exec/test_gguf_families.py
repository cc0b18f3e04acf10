"""GGUF for every family the `gguf` package maps (issue 28, item 5): tiny HF models written as GGUF the way
llama.cpp converts them (tests/helpers/tiny_gguf.py), read back through the gguf package's own name table.

- every architecture the harness writes round-trips: each GGUF tensor comes back under its HF checkpoint name
  with the checkpoint's values (q/k permutation, Gemma's norm offset and stacked experts undone);
- every registry row with a `gguf_arch` loads from GGUF with prefill logits equal to HF's own model on the
  safetensors, at TP 2 and (chunked prefill) TP 1 (a new row's model_type needs a tiny config in `_config`);
- a GGUF's `general.sampling.*` keys are its sampling defaults; an architecture outside the registry is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from model_exec.architectures import ARCHITECTURES
from model_exec.generation_config import sampling_defaults
from model_exec.source import ModelSource, read_model_config, resolve_model
from model_exec.weights import _hf_parameter_names, iter_gguf_tensors, iter_weights
from tests.helpers.family_parity import assert_prefill_matches_hf
from tests.helpers.tiny_gguf import GGUF_ARCH, write_tiny_gguf
from tests.helpers.tiny_models import (
    BOS_ID,
    EOS_ID,
    make_tiny_llama,
    make_tiny_model,
    make_tiny_qwen2,
    make_tiny_untied_rope_scaled,
)

_COMMON: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)
_MOE: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def _config(model_type: str) -> Any:
    """A tiny HF config of `model_type` with the family's parts switched on (q/k norms, experts, ...)."""
    import transformers as tf

    build: dict[str, Callable[[], Any]] = {
        "mistral": lambda: tf.MistralConfig(**_COMMON),
        "mixtral": lambda: tf.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen3": lambda: tf.Qwen3Config(**_COMMON, head_dim=16),
        # soft-caps other than the defaults: GGUF carries them in keys transformers' reader skips
        "gemma2": lambda: tf.Gemma2Config(
            **_COMMON, head_dim=16, sliding_window=8, attn_logit_softcapping=20.0, final_logit_softcapping=15.0
        ),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=8),
        # Phi-4-mini's shape: partial rotary and longrope (prompts stay below the original context)
        "phi3": lambda: tf.Phi3Config(
            **_COMMON,
            pad_token_id=0,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=64,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2, 3, 4], "long_factor": [8.0] * 6},
        ),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**_COMMON, **_MOE, num_experts=4, shared_expert_intermediate_size=48),
        # norm_topk_prob: GGUF has no key for it; transformers assumes Qwen3-MoE's released value (True)
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_COMMON, **_MOE, num_experts=4, head_dim=16, norm_topk_prob=True),
    }
    return build[model_type]()


def _hf_dir(tmp: Path, model_type: str) -> str:
    if model_type == "llama":
        return make_tiny_llama(tmp)
    if model_type == "qwen2":
        return make_tiny_qwen2(tmp)
    return make_tiny_model(tmp / model_type, _config(model_type))


@pytest.mark.parametrize("model_type", sorted(GGUF_ARCH))
def test_gguf_tensors_come_back_as_the_checkpoints(model_type: str, tmp_path: Path) -> None:
    hf_dir = _hf_dir(tmp_path, model_type)
    gguf_dir = Path(write_tiny_gguf(hf_dir, tmp_path / "gguf"))
    checkpoint = {_as_in_memory(k): v for k, v in load_file(str(Path(hf_dir, "model.safetensors"))).items()}
    if _config_tied(hf_dir):
        checkpoint.pop("lm_head.weight", None)  # llama.cpp writes no output.weight for tied embeddings
    seen = {}
    for name, tensor in iter_gguf_tensors(str(gguf_dir / "model.gguf"), _hf_parameter_names(hf_dir)):
        assert name in checkpoint, f"{model_type}: GGUF tensor came back as unknown {name!r}"
        torch.testing.assert_close(tensor, checkpoint[name], rtol=0, atol=1e-6, msg=name)
        seen[name] = tensor
    assert set(seen) == set(checkpoint)


# Mixtral checkpoints say `block_sparse_moe` and w1/w3/w2 where transformers 5 (and so a GGUF read back through
# its names) says `mlp` and gate/up/down_proj; raytp's Mixtral loads both
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _as_in_memory(name: str) -> str:
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"\.experts\.(\d+)\.(w[123])\.", lambda m: f".experts.{m[1]}.{_MIXTRAL_PARTS[m[2]]}.", name)


def _config_tied(hf_dir: str) -> bool:
    return bool(json.loads(Path(hf_dir, "config.json").read_text()).get("tie_word_embeddings"))


# what GGUF does not carry or raytp does not read: names, init, and the file's own architectures list
_NOT_IN_GGUF = {"_name_or_path", "architectures", "initializer_range", "transformers_version", "dtype", "pad_token_id"}


@pytest.mark.slow  # one transformers GGUF read (a child process) per architecture
@pytest.mark.parametrize(
    "model_type", ["qwen3", "gemma2", "gemma3_text", "phi3", "qwen2_moe", "qwen3_moe", "mixtral"]
)
def test_gguf_config_equals_the_hf_config(model_type: str, tmp_path: Path) -> None:
    """The config raytp derives from a GGUF (transformers' reader, completed from the keys it skips: head_dim,
    expert widths, soft-caps) is the HF model's own."""
    hf_dir = _hf_dir(tmp_path, model_type)
    derived = json.loads(
        Path(resolve_model(write_tiny_gguf(hf_dir, tmp_path / "gguf")).metadata_dir, "config.json").read_text()
    )
    original = json.loads(Path(hf_dir, "config.json").read_text())
    for cfg in (original, derived):  # no head_dim (or None) means hidden_size / heads, which GGUF may spell out
        if cfg.get("head_dim") is None:
            cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    # GGUF stores floats as float32 (rms_norm_eps, rope factors): compare to 6 significant digits
    assert _rounded({k: v for k, v in original.items() if k not in _NOT_IN_GGUF}) == _rounded(
        {k: derived.get(k) for k in original if k not in _NOT_IN_GGUF}
    )


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


# every registry row that loads from GGUF, by the HF model_type its tiny model is built as
GGUF_FAMILIES = sorted({a.model_type for a in ARCHITECTURES.values() if a.gguf_arch is not None})


def test_gguf_llama3_rope_scaling_and_biases_load_with_hf_parity(tmp_path: Path) -> None:
    """Llama 3.1's rope scaling travels as rope_freqs divisors only; raytp recovers the parameters (here also
    an untied head, head_dim apart from hidden size, and biases on q/k/v/o and the MLP)."""
    hf_dir = make_tiny_untied_rope_scaled(tmp_path)
    gguf_dir = write_tiny_gguf(hf_dir, tmp_path / "gguf")
    ours, theirs = (read_model_config(resolve_model(d)) for d in (gguf_dir, hf_dir))
    assert ours.rope_scaling == theirs.rope_scaling
    assert_prefill_matches_hf(gguf_dir, world_sizes=(2,), reference_dir=hf_dir)


@pytest.mark.parametrize("model_type", GGUF_FAMILIES)
def test_gguf_family_loads_with_hf_parity(model_type: str, tmp_path: Path) -> None:
    hf_dir = _hf_dir(tmp_path, model_type)
    gguf_dir = write_tiny_gguf(hf_dir, tmp_path / "gguf")
    # TP 2: each rank cuts its shard from the renamed tensors; TP 1 runs in the chunked-prefill check
    assert_prefill_matches_hf(gguf_dir, world_sizes=(2,), reference_dir=hf_dir)


def test_gguf_metadata_gives_generation_defaults_and_eos_ids(tmp_path: Path) -> None:
    sampling = {"temp": 0.5, "top_k": 7}
    gguf_dir = write_tiny_gguf(make_tiny_llama(tmp_path), tmp_path / "gguf", sampling=sampling, eot_id=9)
    src = resolve_model(gguf_dir)
    assert sampling_defaults(src, "auto") == {"temperature": 0.5, "top_k": 7}
    assert sampling_defaults(src, "vllm") == {}
    assert read_model_config(src, generation_config="vllm").eos_token_ids == (EOS_ID, 9)  # EOT ends generation


def test_gguf_architecture_outside_the_registry_is_refused(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "bloom")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'bloom' is not supported"):
        next(iter_weights(ModelSource("gguf", str(tmp_path), "m.gguf", "m")))
