"""Tiny GGUF files written from tiny HF models, as llama.cpp's converter (convert_hf_to_gguf.py) writes them:
the metadata keys transformers' GGUF config loader reads for the architecture, the byte tokenizer, and the
checkpoint's tensors renamed by the `gguf` package's own table, with the converter's per-architecture
changes: llama's q/k row permutation, Gemma's norms stored as (1 + w), experts stacked into one tensor per
projection, no output.weight when the embeddings are tied. Tensors stay float32 (F32), so a loaded GGUF
must match the HF model as closely as its safetensors do.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.kquants import Q4_K, Q6_K, quantize_kquant
from tests.helpers.tiny_models import BOS_ID, CHAT_TEMPLATE, EOS_ID

# HF model_type -> GGUF general.architecture (what llama.cpp names it)
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",  # llama.cpp writes Mixtral as llama with experts
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
}
_NORM_PLUS_ONE = ("gemma2", "gemma3")
_EXPERT = re.compile(r"(?P<stem>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight")


def _metadata(writer: Any, arch: str, cfg: dict[str, Any]) -> None:
    """The `{arch}.*` keys transformers' GGUF_CONFIG_MAPPING reads (transformers.integrations.ggml)."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type; GGUF's freq_base is the global layers'
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if arch in ("gemma2", "gemma3", "qwen3", "qwen3moe"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if cfg.get("sliding_window") is not None and arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
    if rope.get("rope_type") == "longrope":  # the factors travel as tensors (gguf_tensors)
        original = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(cap) is not None:
            getattr(writer, f"add_{cap}")(cfg[cap])
    if "num_experts" in cfg or "num_local_experts" in cfg:
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _tokenizer(writer: Any, hf_dir: Path, vocab_size: int) -> None:
    """The dir's byte tokenizer as a GGUF `gpt2` (byte-level BPE) vocabulary, padded to the model's size."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    tokens = [by_id.get(i, f"<extra_{i}>") for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(EOS_ID)
    writer.add_chat_template(CHAT_TEMPLATE)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotate-half rows into interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs: per frequency, the divisor llama3 scaling applies."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def gguf_tensors(hf_dir: Path, arch: str, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """GGUF name -> array for every checkpoint tensor of `hf_dir`, converted as llama.cpp converts it."""
    import gguf
    from safetensors.numpy import load_file

    arch_id = {name: i for i, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    table = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"])
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    experts: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        if m := _EXPERT.fullmatch(name):  # stacked below, [num_experts, ...] per projection
            experts[f"{m['stem']}.{m['proj']}"][int(m["e"])] = array
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is None:
            raise ValueError(f"the gguf package maps no {arch} tensor to {name!r}")
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = cfg["num_attention_heads"] if base.endswith("q_proj") else cfg["num_key_value_heads"]
            array = _llama_cpp_permute(array, heads)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            array = array + 1.0
        out[f"{gguf_name}.{suffix}"] = array
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp's Llama converter: the divisors, not the parameters
        out["rope_freqs.weight"] = _llama3_rope_freqs(rope, cfg["head_dim"])
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi-3 converter: the factors as two tensors
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)
    for base, per_expert in experts.items():
        gguf_name = table.get_name(base)
        if gguf_name is None:
            raise ValueError(f"the gguf package maps no {arch} tensor to {base!r}")
        out[f"{gguf_name}.weight"] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def write_tiny_gguf(
    hf_dir: str | Path,
    out_dir: str | Path,
    sampling: dict[str, float] | None = None,
    eot_id: int | None = None,
    quant_types: dict[str, Any] | None = None,
) -> str:
    """`out_dir`/model.gguf from the tiny HF model in `hf_dir` (see the module's docstring); returns the dir.

    `sampling`: `general.sampling.*` keys to write (temp, top_k, top_p, min_p, penalty_repeat), as llama.cpp's
    converter writes them from a generation_config.json; `eot_id`: an end-of-turn token id (Llama 3's
    <|eot_id|>), which llama.cpp stops at as it stops at EOS. `quant_types`: GGUF tensor-name substring ->
    gguf.GGMLQuantizationType, the first match quantizes a 2-D tensor with whole blocks in its rows (by the
    `gguf` package's own quantizer, as llama.cpp's converter writes Q8_0; Q4_K / Q6_K by tests.helpers.kquants);
    the rest stay F32.
    """
    import gguf

    hf_dir, out = Path(hf_dir), Path(out_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    out.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out / "model.gguf"), arch)
    writer.add_name(f"tiny-{cfg['model_type']}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _metadata(writer, arch, cfg)
    _tokenizer(writer, hf_dir, cfg["vocab_size"])
    if eot_id is not None:
        writer.add_eot_token_id(eot_id)
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    for name, array in gguf_tensors(hf_dir, arch, cfg).items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        qtype = next((q for key, q in (quant_types or {}).items() if key in name), None)
        if qtype is not None and array.ndim == 2 and array.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            if int(qtype) in (Q4_K, Q6_K):  # the `gguf` package cannot quantize these: the tests' own writer
                writer.add_tensor(name, quantize_kquant(array, int(qtype)), raw_dtype=qtype)
            else:
                writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)
