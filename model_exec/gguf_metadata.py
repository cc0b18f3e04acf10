"""`python -m model_exec.gguf_metadata GGUF_FILE TARGET_DIR`: a GGUF's config and tokenizer as HF files,
and a generation_config.json from its `general.sampling.*` keys (llama.cpp's converter writes them from
the model's generation_config.json; `model_exec.generation_config` reads them back) and its EOS, EOT and
EOM token ids (all of them end generation, as in llama.cpp).

transformers' GGUF config reader leaves out keys that llama.cpp writes and the families need (Qwen3's
head_dim, the MoE expert widths, Gemma 2's soft-caps, Mixtral's experts, partial rotary, Phi-3's
longrope factors, Llama 3's rope scaling, biases): those fields would keep the config class's defaults, wrong for
most models.
`complete_config` fills them from the file.

Run by `model_exec.source.gguf_metadata_dir` in a child process, because transformers' GGUF reader
imports torch and the control plane must not. Writes into a temporary sibling of TARGET_DIR and
renames it into place, so a reader never sees half a directory; losing a race to another process
is fine (its copy is identical).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# GGUF `general.sampling.*` key -> the generation_config.json field it was converted from
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


# GGUF `{arch}.` key -> the HF config field it holds, for keys transformers' reader does not map
_EXTRA_CONFIG_KEYS = {
    "attention.key_length": "head_dim",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}


def complete_config(config: Any, gguf_file: Path) -> Any:
    """`config` (a transformers config read from `gguf_file`) with what transformers' reader leaves out
    although the file holds it: the fields of `_EXTRA_CONFIG_KEYS` the config class has, and Mixtral,
    which llama.cpp writes as a `llama` file with experts and the reader takes for a dense Llama."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file)
    fields = reader.fields
    arch = str(fields["general.architecture"].contents())
    if arch == "llama" and "llama.expert_count" in fields:
        from transformers import MixtralConfig

        own = set(MixtralConfig().to_dict()) - {"model_type", "architectures", "transformers_version"}
        config = MixtralConfig(
            **{k: v for k, v in config.to_dict().items() if k in own},
            num_local_experts=int(fields["llama.expert_count"].contents()),
            num_experts_per_tok=int(fields["llama.expert_used_count"].contents()),
        )
    for key, name in _EXTRA_CONFIG_KEYS.items():
        if f"{arch}.{key}" in fields and hasattr(config, name):
            setattr(config, name, fields[f"{arch}.{key}"].contents())
    # biases are in the tensors only (Llama's attention_bias / mlp_bias; Qwen2's are unconditional)
    tensors = {t.name for t in reader.tensors}
    if hasattr(config, "attention_bias") and "blk.0.attn_q.bias" in tensors:
        config.attention_bias = True
    if hasattr(config, "mlp_bias") and "blk.0.ffn_down.bias" in tensors:
        config.mlp_bias = True
    _complete_rope(config, reader, arch)
    return config


def _complete_rope(config: Any, reader: Any, arch: str) -> None:
    """Partial rotary (`{arch}.rope.dimension_count` below head_dim), Phi-3's longrope, whose factors
    llama.cpp stores as the tensors rope_factors_long/short, and Llama 3's rope scaling, stored as the tensor
    rope_freqs: transformers' reader keeps none of them."""
    fields = reader.fields
    rope = dict(getattr(config, "rope_parameters", None) or {})
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = "partial_rotary_factor" in rope or hasattr(config, "partial_rotary_factor")  # the class has one
    if partial and f"{arch}.rope.dimension_count" in fields:
        config.partial_rotary_factor = int(fields[f"{arch}.rope.dimension_count"].contents()) / head_dim
        rope["partial_rotary_factor"] = config.partial_rotary_factor
    factors = {t.name.split(".")[0]: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if {"rope_factors_long", "rope_factors_short"} <= set(factors):
        original = int(fields[f"{arch}.rope.scaling.original_context_length"].contents())
        rope.update(
            rope_type="longrope",
            long_factor=[float(x) for x in factors["rope_factors_long"].data],
            short_factor=[float(x) for x in factors["rope_factors_short"].data],
            original_max_position_embeddings=original,
        )
        config.original_max_position_embeddings = original
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        rope.update(_llama3_rope([float(x) for x in freqs.data], float(rope.get("rope_theta", 10000.0)), head_dim))
    if rope:
        config.rope_parameters = rope


def _llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int) -> list[float]:
    """The per-frequency divisors llama.cpp's converter stores as `rope_freqs` for llama3 rope scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _llama3_rope(freqs: list[float], theta: float, head_dim: int) -> dict[str, Any]:
    """The llama3 rope parameters whose divisors are `freqs` (Llama 3.1+ GGUFs carry only the divisors):
    the factor is the largest divisor; the band edges and the original context are searched over the values
    Llama 3.x releases use and powers of two. Raises ValueError when none reproduces them."""
    factor = max(freqs)
    for original in [8192, *(2**k for k in range(4, 21))]:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 8.0)):
            candidate = _llama3_factors(theta, head_dim, factor, low, high, original)
            if all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(candidate, freqs, strict=True)):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": original,
                }
    raise ValueError("the GGUF's rope_freqs match no llama3 rope scaling; raytp cannot apply them")


# end-of-generation token ids: llama.cpp stops at each (Llama 3's <|eot_id|> and <|eom_id|> besides EOS)
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def generation_config(gguf_file: Path) -> dict[str, Any]:
    """The generation_config.json that the GGUF's metadata amounts to: the `general.sampling.*` defaults,
    and as `eos_token_id` every end-of-generation id the file names."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_file).fields
    out = {name: fields[key].contents() for key, name in _SAMPLING_KEYS.items() if key in fields}
    eos = [int(fields[key].contents()) for key in _EOS_KEYS if key in fields]
    if eos:
        out["eos_token_id"] = list(dict.fromkeys(eos))
    return out


def convert(gguf_file: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        config = complete_config(AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name), gguf_file)
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(tmp)
        gen = generation_config(gguf_file)
        if gen:
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m model_exec.gguf_metadata GGUF_FILE TARGET_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
