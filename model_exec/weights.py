"""Streaming a model's tensors in HF naming, one at a time, from safetensors or a GGUF file.

Tensors are yielded as full (unsharded) CPU tensors; each parameter's weight_loader cuts its own
shard, so no rank ever holds more than one full checkpoint tensor beyond its shard. Resolving the
model (where it is, its config and tokenizer) is torch-free and lives in `model_exec.source`.
"""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model_exec.architectures import ARCHITECTURES
from model_exec.layers.quantization.gguf_tensor import KERNEL_TYPES, GGUFTensor
from model_exec.source import ModelSource, safetensors_files

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)


def iter_weights(src: ModelSource, keep_gguf_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """Yield (HF checkpoint name, full CPU tensor) one tensor at a time.

    `keep_gguf_blocks` (a GGUF file, layers built under `quantization.gguf.GGUFConfig`): matrices of the types
    the block kernels run (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) come as `GGUFTensor`s in their file layout, the rest as
    floats."""
    if src.kind == "gguf":
        yield from _iter_gguf(src, keep_gguf_blocks)
    else:
        yield from _iter_safetensors(Path(src.path))


# ---- safetensors -----------------------------------------------------------------------------


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


# ---- GGUF ----------------------------------------------------------------------------------
# Names come from the `gguf` package's own HF -> GGUF table (gguf.TensorNameMap, what llama.cpp's converter
# uses), inverted over the checkpoint names Hugging Face gives the model: that table lists many HF spellings
# per GGUF tensor (one per family that ever used it), and only the model's own names pick the right one.

# recomputed from the config's rope parameters, never weights
_GGUF_SKIP = ("rope_freqs", "rope_factors_long", "rope_factors_short", "attn_rot_embd")
# llama.cpp stores Gemma's RMSNorm weights as (1 + w), the factor the norm applies; HF keeps w
_NORM_PLUS_ONE_ARCHS = ("gemma", "gemma2", "gemma3")
_EXPERTS = re.compile(r"(?P<prefix>.*\.experts)\.(?P<proj>\w+)")


def supported_gguf_archs() -> tuple[str, ...]:
    """GGUF `general.architecture` values that load: the registry rows' `gguf_arch`."""
    return tuple(sorted({a.gguf_arch for a in ARCHITECTURES.values() if a.gguf_arch is not None}))


def hf_checkpoint_names(hf_names: Iterable[str]) -> list[str]:
    """Checkpoint names (without .weight/.bias) from Hugging Face's in-memory parameter names.

    transformers 5 fuses MoE experts in memory (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, one
    3-D tensor each) while checkpoints keep one tensor per expert; GGUF keeps gate and up apart, so the
    fused name stands for both. Per-expert names (`experts.3.gate_proj`) fold into the stacked one.
    """
    out: list[str] = []
    for name in hf_names:
        base = re.sub(r"\.(weight|bias)$", "", name)
        base = re.sub(r"\.experts\.\d+\.", ".experts.", base)
        if base.endswith(".experts.gate_up_proj"):
            stem = base.removesuffix("gate_up_proj")
            out += [stem + "gate_proj", stem + "up_proj"]
        else:
            out.append(base)
    return out


def gguf_name_map(arch: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name (without .weight/.bias) -> HF checkpoint name, for GGUF architecture `arch`:
    the `gguf` package's mapping from each of the model's HF names, inverted."""
    import gguf

    arch_ids = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in arch_ids:
        raise ValueError(f"the gguf package does not know GGUF architecture {arch!r}")
    table = gguf.get_tensor_name_map(arch_ids[arch], num_layers)
    mapping: dict[str, str] = {}
    for hf in hf_checkpoint_names(hf_names):
        gguf_name = table.get_name(hf)
        if gguf_name is not None:
            mapping.setdefault(gguf_name, hf)
    return mapping


def gguf_to_hf_names(gguf_name: str, mapping: dict[str, str], num_experts: int = 0) -> list[str]:
    """The HF checkpoint names a GGUF tensor loads as: [] for tensors to skip, one per expert for stacked
    expert tensors (`blk.N.ffn_gate_exps` -> `...mlp.experts.E.gate_proj.weight`), else one.
    Raises ValueError for a tensor the mapping does not know."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.rpartition(".")[2] in _GGUF_SKIP:
        return []
    if suffix not in ("weight", "bias") or base not in mapping:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    hf = mapping[base]
    m = _EXPERTS.fullmatch(hf)
    if m and base.endswith("_exps"):
        return [f"{m['prefix']}.{e}.{m['proj']}.{suffix}" for e in range(num_experts)]
    return [f"{hf}.{suffix}"]


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time q/k row permutation (interleaved -> rotate-half rotary layout).

    llama.cpp stores each head's rows as pairs (x0, x_{d/2}, x1, x_{d/2+1}, ...); HF keeps halves.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_parameter_names(config_dir: str) -> list[str]:
    """Hugging Face's parameter names for the model whose config.json is in `config_dir` (built on the meta
    device: names and shapes, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return list(model.state_dict())


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    """The parsed GGUF at `path` as it is now (its mtime and size in the key), kept for the process's next engine:
    building a reader parses every metadata field in Python (SmolLM2's 49k-token vocabulary: ~1-2.5 s on the
    2-core machines, at every engine start). Safe to share: the reader maps the file read-only, and every
    tensor taken from it is copied or dequantized into memory of its own (`iter_gguf_tensors`)."""
    from gguf import GGUFReader

    return GGUFReader(path)


def _iter_gguf(src: ModelSource, keep_blocks: bool) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    stat = Path(src.gguf_path).stat()
    reader = _gguf_reader(str(src.gguf_path), stat.st_mtime_ns, stat.st_size)
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in supported_gguf_archs():
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {supported_gguf_archs()}")
    yield from iter_gguf_tensors(reader, _hf_parameter_names(src.metadata_dir), keep_blocks)


def iter_gguf_tensors(
    path: str | GGUFReader, hf_names: Iterable[str], keep_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(HF checkpoint name, full float tensor) for every weight of the GGUF file `path` (or its open reader),
    whose model has Hugging Face parameter names `hf_names`; llama.cpp's convert-time changes undone. With
    `keep_blocks`, single matrices of a kernel type come as `GGUFTensor`s (whole rows move, so the q/k row
    permutation is undone on the blocks as on floats); other quantized types are dequantized, and named in
    one log line."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path) if isinstance(path, str) else path
    arch = str(reader.fields["general.architecture"].contents())

    def field(key: str, default: int = 0) -> int:
        return int(reader.fields[key].contents()) if key in reader.fields else default

    n_head, n_kv_head = field(f"{arch}.attention.head_count"), field(f"{arch}.attention.head_count_kv")
    num_experts = field(f"{arch}.expert_count")
    mapping = gguf_name_map(arch, field(f"{arch}.block_count"), hf_names)
    dequantized: Counter[str] = Counter()
    for tensor in reader.tensors:
        names = gguf_to_hf_names(tensor.name, mapping, num_experts)
        if not names:
            continue
        qtype = int(tensor.tensor_type)
        if keep_blocks and qtype in KERNEL_TYPES and len(names) == 1 and len(tensor.data.shape) == 2:
            rows = torch.from_numpy(np.array(tensor.data))  # a copy: the reader's view is the read-only file map
            blocks = GGUFTensor(rows, qtype, int(tensor.shape[0]))  # GGUF shapes list the row length first
            if arch == "llama" and ".self_attn.q_proj." in names[0]:
                blocks = blocks.index_rows(_unpermute_qk(torch.arange(rows.shape[0]), n_head))
            elif arch == "llama" and ".self_attn.k_proj." in names[0]:
                blocks = blocks.index_rows(_unpermute_qk(torch.arange(rows.shape[0]), n_kv_head))
            yield names[0], blocks
            continue
        if keep_blocks and qtype not in (0, 1, 30):  # F32, F16, BF16 are floats anyway
            dequantized[tensor.tensor_type.name] += 1
        array = dequantize(tensor.data, tensor.tensor_type)  # one tensor at a time; float32 for quantised
        if not array.flags.writeable:  # unquantised tensors come back as read-only views of the file map
            array = np.array(array)
        weight = torch.from_numpy(array)
        # llama.cpp permutes q/k only for its llama architecture (Llama, Mistral, SmolLM2), not qwen2
        if arch == "llama" and ".self_attn.q_proj." in names[0]:
            weight = _unpermute_qk(weight, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in names[0]:
            weight = _unpermute_qk(weight, n_kv_head)
        elif arch in _NORM_PLUS_ONE_ARCHS and names[0].endswith("norm.weight"):
            weight = weight - 1.0
        elif tensor.name.endswith("ffn_gate_inp_shexp.weight") and weight.dim() == 1:
            weight = weight.unsqueeze(0)  # HF's shared_expert_gate is a [1, hidden] linear
        if len(names) == 1:
            yield names[0], weight
        else:  # stacked experts [num_experts, ...]: one tensor each, as checkpoints keep them
            yield from zip(names, weight.unbind(0), strict=True)
    if dequantized:
        kinds = ", ".join(f"{name} x {count}" for name, count in sorted(dequantized.items()))
        logger.info("GGUF tensors without a block kernel load dequantized to float32: %s", kinds)
