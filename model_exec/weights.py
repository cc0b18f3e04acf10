"""Streaming a model's tensors in HF naming, one at a time, from safetensors or a GGUF file.

Tensors are yielded as full (unsharded) CPU tensors; each parameter's weight_loader cuts its own
shard, so no rank ever holds more than one full checkpoint tensor beyond its shard. Resolving the
model (where it is, its config and tokenizer) is torch-free and lives in `model_exec.source`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from model_exec.source import ModelSource, safetensors_files


def iter_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, full CPU tensor) one tensor at a time."""
    if src.kind == "gguf":
        yield from _iter_gguf(src.gguf_path)
    else:
        yield from _iter_safetensors(Path(src.path))


# ---- safetensors -----------------------------------------------------------------------------


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


# ---- GGUF ------------------------------------------------------------------------------------

# GGUF tensor name (without .weight/.bias) -> HF name; blk.N.* are per layer
_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_SKIP = {"rope_freqs"}  # derived from the config's rope parameters, not a weight
_GGUF_ARCHS = ("llama", "qwen2")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """HF name for a GGUF tensor name; None for tensors to skip. Raises ValueError if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GGUF_SKIP:
        return None
    if base in _GGUF_GLOBAL and suffix in ("weight", "bias"):
        return f"{_GGUF_GLOBAL[base]}.{suffix}"
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time q/k row permutation (interleaved -> rotate-half rotary layout).

    llama.cpp stores each head's rows as pairs (x0, x_{d/2}, x1, x_{d/2+1}, ...); HF keeps halves.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _iter_gguf(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {_GGUF_ARCHS}")
    n_head = int(reader.fields[f"{arch}.attention.head_count"].contents())
    n_kv_head = int(reader.fields[f"{arch}.attention.head_count_kv"].contents())
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        if name is None:
            continue
        array = dequantize(tensor.data, tensor.tensor_type)  # one tensor at a time; float32 for quantised
        if not array.flags.writeable:  # unquantised tensors come back as read-only views of the file map
            array = np.array(array)
        weight = torch.from_numpy(array)
        # llama.cpp permutes q/k only for its llama architecture (Llama, Mistral, SmolLM2), not qwen2
        if arch == "llama" and ".self_attn.q_proj." in name:
            weight = _unpermute_qk(weight, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            weight = _unpermute_qk(weight, n_kv_head)
        yield name, weight
