"""The benchmark model as a Hugging Face safetensors directory, so raytp and vLLM read identical weights.

The embedded default model is a GGUF file (SmolLM2-135M-Instruct, Q4_1). transformers dequantizes a GGUF
to float32 when it loads it with `gguf_file=`; `save_pretrained` then writes that as an fp32 safetensors
directory with config, generation config and tokenizer. Both engines load that directory, so neither
benchmarks its own dequantization and both run the very same fp32 numbers.

The conversion runs once into $RAYTP_CACHE_DIR/hf (default ~/.cache/raytp/hf), keyed by the source
file's path, size and mtime; it is written aside and renamed, so a crashed or concurrent run never
leaves a half-written directory behind.

    python -m benchmarks.common.hf_model            # prints the directory (converting first if needed)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch


def hf_model_dir(model: str | None = None) -> str:
    """An HF safetensors directory for `model` (default: the embedded GGUF); safetensors dirs pass through."""
    from model_exec.source import resolve_model

    src = resolve_model(model)
    if src.kind == "safetensors":
        return src.path
    gguf_path = Path(src.gguf_path).resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    root = Path(os.environ.get("RAYTP_CACHE_DIR", Path.home() / ".cache" / "raytp")) / "hf"
    target = root / f"{gguf_path.stem}-f32-{key}"
    if (target / "config.json").is_file():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=root))
    try:
        _convert(str(gguf_path.parent), gguf_path.name, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _convert(path: str, gguf_file: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    # The tensors are already dequantized to fp32; only the GGUF markers would stop save_pretrained and make
    # readers expect a quantized checkpoint.
    setattr(model, "hf_quantizer", None)  # noqa: B010 (nn.Module's typed __setattr__ refuses None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(path, gguf_file=gguf_file).save_pretrained(out)


if __name__ == "__main__":
    import sys

    print(hf_model_dir(sys.argv[1] if len(sys.argv) > 1 else None))
