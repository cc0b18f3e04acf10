"""`python -m model_exec.gguf_metadata GGUF_FILE TARGET_DIR`: a GGUF's config and tokenizer as HF files.

Run by `model_exec.source.gguf_metadata_dir` in a child process, because transformers' GGUF reader
imports torch and the control plane must not. Writes into a temporary sibling of TARGET_DIR and
renames it into place, so a reader never sees half a directory; losing a race to another process
is fine (its copy is identical).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path


def convert(gguf_file: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(tmp)
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
