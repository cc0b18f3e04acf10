"""The C++ CPU kernels (`csrc/paged_decode.cpp`, `csrc/paged_prefill.cpp`, `../csrc/fused_layers.cpp`,
`../csrc/panel_gemm.cpp`, `../csrc/kv_write.cpp`, `../csrc/gguf_gemm.cpp`, `../csrc/gguf_kquants.cpp`,
`../csrc/gguf_q4x16.cpp`, `../csrc/gguf_q8x16.cpp`, `../csrc/decode_layer.cpp`), compiled into one library
once per machine at first use and cached.

`torch.utils.cpp_extension.load` builds the sources with the system's g++ and ninja into torch's
extension cache (`$TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), so concurrent
processes (Ray workers) build once and later processes only load the library (~0.1 s). The
library's name (and folder) carries a hash of the sources, the headers they include and the ISA
flags (`build_name`), so what is loaded is always built from exactly the running sources (an op
whose signature changed, as the attention kernels' did for sliding windows, is never called with
another layout), without relying on ninja's timestamps, and checkouts that share the cache (git
worktrees, an older install) no longer rebuild each other's library at every switch; each version
keeps a folder of ~1 MB. `.ci/setup.sh` builds it at install time; the first engine start on a
fresh machine otherwise pays ~10 s.

Locking: torch guards every `load()` (even one that only finds the library up to date) with a
`lock` file that it deletes when done; a process killed inside that window (a Ray worker killed
by `ray.kill`, the OOM killer, Ctrl-C) leaves the file behind and every later `load()` on the
machine waits for it forever. So `load()` runs under an `flock` of our own, which the kernel
releases when its holder dies; whoever holds it is the only raytp loader, so a torch `lock` file
found then is stale and is removed.

The build is compiled for this machine's vector ISA (AVX2 + FMA when torch reports AVX2 or
better; the capability is part of the extension's name, so machines sharing a cache never load a
library built for another ISA). AVX-512 code is not a separate build: the kernels carry it in functions
of their own and pick it at run time where the CPU has AVX-512F (`raytp::use_avx512` in
`ops/csrc/vec_math.h`; `RAYTP_CPU_NO_AVX512=1` turns it off). When no compiler or ninja is usable,
`load()` says why, the `auto` attention backend stays on the pure-torch one and the model layers keep
their torch code.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name("csrc") / "paged_decode.cpp",
    Path(__file__).with_name("csrc") / "paged_prefill.cpp",
    Path(__file__).parents[1] / "csrc" / "fused_layers.cpp",  # ops/fused.py's norm, rotary and SiLU kernels
    Path(__file__).parents[1] / "csrc" / "panel_gemm.cpp",  # model_exec/layers/cpu_gemm.py's few-row linear
    Path(__file__).parents[1] / "csrc" / "kv_write.cpp",  # ops/cache_ops.py's write_to_paged_cache
    Path(__file__).parents[1] / "csrc" / "gguf_gemm.cpp",  # model_exec/layers/quantization's GGUF linear
    Path(__file__).parents[1] / "csrc" / "gguf_kquants.cpp",  # its Q4_K / Q6_K kernels
    Path(__file__).parents[1] / "csrc" / "gguf_dequant_gemm.cpp",  # its many-row (prefill) road
    Path(__file__).parents[1] / "csrc" / "gguf_q8_rows.cpp",  # its Q8_0 decode tile
    Path(__file__).parents[1] / "csrc" / "gguf_q4x16.cpp",  # its Q4_0 / Q4_1 decode road on a repacked layout
    Path(__file__).parents[1] / "csrc" / "gguf_q8x16.cpp",  # its Q8_0 integer road on a repacked layout
    Path(__file__).parents[1] / "csrc" / "decode_layer.cpp",  # ops/fused_decode.py's one-call decoder layer
]
# Headers the sources include: part of `build_name`'s hash, so an edited header builds anew too.
_HEADERS = [
    Path(__file__).parents[1] / "csrc" / "vec_math.h",
    Path(__file__).parents[1] / "csrc" / "gguf_kquants.h",
    Path(__file__).parents[1] / "csrc" / "gguf_dequant_gemm.h",
    Path(__file__).parents[1] / "csrc" / "gguf_q8_rows.h",
    Path(__file__).parents[1] / "csrc" / "gguf_q4x16.h",
    Path(__file__).parents[1] / "csrc" / "gguf_q8x16.h",
]
# Every op the sources register: the library counts as loaded only when all of them are there.
_OPS = (
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "rotate_half_rope",
    "silu_and_mul",
    "panel_linear",
    "panel_linear_silu_mul",
    "write_kv_cache",
    "gguf_linear",
    "gguf_q4x16_pack",
    "gguf_q8x16_pack",
    "decode_layer",
)


def vectorized() -> bool:
    """True when the kernels are built for AVX2 + FMA (their fast paths); False for the portable build."""
    return _isa_flags()[0] == "avx2"


def _isa_flags() -> tuple[str, list[str]]:
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


def build_name() -> str:
    """The library's name: its ISA and a hash of everything it is built from (sources, headers, flags)."""
    isa, flags = _isa_flags()
    digest = hashlib.sha256()
    for path in (*_SOURCES, *_HEADERS):
        digest.update(path.read_bytes())
    digest.update(" ".join(flags).encode())
    return f"raytp_cpu_kernels_{isa}_{digest.hexdigest()[:12]}"


def _ensure_ninja_on_path() -> None:
    """torch looks for `ninja` on PATH; the PyPI `ninja` package puts it next to the venv's python."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        return
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def build_directory(name: str) -> Path:
    """Where `name` is built: a folder under torch's extension cache root, per Python version."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    folder = Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@functools.cache
def load_error() -> str | None:
    """Build (or reuse) and load the kernels into `torch.ops.raytp_cpu`; None on success, else why not."""
    if hasattr(torch.ops, "raytp_cpu") and all(hasattr(torch.ops.raytp_cpu, op) for op in _OPS):
        return None
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    _, flags = _isa_flags()
    name = build_name()
    try:
        folder = build_directory(name)
        with open(folder / "raytp.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
            (folder / "lock").unlink(missing_ok=True)  # torch's own lock: stale if present now
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in _SOURCES],
                # -fopenmp: at::parallel_for is OpenMP code inlined from torch's headers (without the flag
                # it runs serially); the library links the libgomp.so.1 that torch has already loaded.
                extra_cflags=["-O3", "-fopenmp", *flags],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, a broken cache: the torch backend still works
        reason = f"the C++ CPU kernels could not be built or loaded ({type(exc).__name__}: {exc})"
        logger.warning("%s; attention and the fused layers fall back to torch", reason.splitlines()[0])
        return reason
    return None


def _window_and_cap(sliding_window: int | None, logits_soft_cap: float | None) -> tuple[int, float]:
    """The kernels' encoding of the per-layer options (ops/attention/base.py): 0 means none."""
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        raise ValueError(f"sliding_window must be a positive integer or None; got {sliding_window!r}.")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive or None; got {logits_soft_cap!r}.")
    return sliding_window or 0, float(logits_soft_cap or 0.0)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """out[r] = softmax(scale * q_r K_r^T) V_r for one query token per row, K/V read in place from the
    paged cache through block_tables[r] up to seq_lens[r] (only the last `sliding_window` of them when
    given; scores soft-capped when `logits_soft_cap` is given). fp32 CPU tensors; call `load_error()` first."""
    window, cap = _window_and_cap(sliding_window, logits_soft_cap)
    torch.ops.raytp_cpu.paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, window, cap, out
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    first_row: int,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Causal attention of rows [first_row, rows): row r's queries are query[query_start_loc[r]:
    query_start_loc[r + 1]], the last of its seq_lens[r] positions; keys and values (this step's
    included) are read in place from the paged cache; `sliding_window` / `logits_soft_cap` as in
    ops/attention/base.py. fp32 CPU tensors, head_dim a multiple of 8; needs the AVX2 build
    (`vectorized()`) and `load_error()` first."""
    window, cap = _window_and_cap(sliding_window, logits_soft_cap)
    torch.ops.raytp_cpu.paged_prefill_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, first_row, scale, window, cap, out
    )
