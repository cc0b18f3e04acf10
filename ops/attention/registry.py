"""The one table of attention backends, torch-free: what each backend can do, next to the backends.

Every rule about a backend lives in its row: where it runs, which dtypes, which KV block sizes, whether a
decode step can be captured into a CUDA graph, which per-layer options it implements, what must import
for it. `cluster.engine.resolve_config` reads the rows to decide the dtype, the block size and the
backend candidates once, before any worker starts (no torch needed); `ops.attention.get_attn_backend`
reads the same rows on the rank, where only what a process can know about itself (a package imports,
the C++ kernels build, a GPU is visible) is still open. A new backend is its file plus one row here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ops.dtypes import DTYPES, HALF_DTYPES


@dataclass(frozen=True)
class BackendRow:
    name: str
    module: str  # under ops.attention, imported only when the backend is chosen
    class_name: str
    devices: tuple[str, ...]  # "cpu" / "cuda"
    dtypes: tuple[str, ...]  # canonical names (ops.dtypes) of the KV/activation dtypes its kernels take
    block_multiple: int = 1  # the KV block size must be a multiple of this
    capturable: bool = False  # a pure-decode forward may be captured into a CUDA graph (contract: base.py)
    sliding_window: bool = False  # per-layer options it implements (semantics: base.py); others are refused
    logits_soft_cap: bool = False
    package: str | None = None  # the module that must import for it to run
    requirement: str = ""  # the pip requirement that provides `package`
    # Its place in `auto`'s order of preference (lower first); None: auto never picks it (why: `not_auto`).
    auto_rank: int | None = None
    not_auto: str = ""


BACKENDS: dict[str, BackendRow] = {
    row.name: row
    for row in (
        # The reference every kernel test compares with; `auto`'s fallback where nothing better runs.
        BackendRow("torch", "torch_backend", "TorchAttentionBackend", ("cpu", "cuda"), DTYPES,
                   sliding_window=True, logits_soft_cap=True),
        # C++ paged kernels built at first use (g++ and ninja); fp32 only.
        BackendRow("cpu", "cpu_backend", "CpuAttentionBackend", ("cpu",), ("float32",),
                   sliding_window=True, logits_soft_cap=True, auto_rank=2),
        # Ships with CUDA torch; reads K/V through the block table in place, any block size, head_dim <= 256.
        BackendRow("triton", "triton_backend", "TritonAttentionBackend", ("cuda",), DTYPES, capturable=True,
                   sliding_window=True, logits_soft_cap=True, package="triton", requirement="triton", auto_rank=1),
        # Upstream's paged-KV kernels take only page sizes that are multiples of 256.
        BackendRow("flash_attn", "flash_attn_backend", "FlashAttnBackend", ("cuda",), HALF_DTYPES,
                   block_multiple=256, capturable=True, sliding_window=True, logits_soft_cap=True,
                   package="flash_attn", requirement="flash-attn>=2.6", auto_rank=0),
        BackendRow("xformers", "xformers_backend", "XFormersBackend", ("cuda",), DTYPES, sliding_window=True,
                   package="xformers.ops", requirement="xformers>=0.0.28",
                   not_auto="it gathers every row's whole context per layer (not paged in place)"),
    )
}  # fmt: skip
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", *BACKENDS)  # "auto" picks one of them (ops.attention)
FALLBACK = "torch"  # what `auto` runs when no candidate is usable: it runs everywhere


def static_reason(
    row: BackendRow, device: str, dtype: str | None, block_size: int | None, strict: bool = True
) -> str | None:
    """Why `row` cannot run this configuration, by its row alone (no imports), or None. `dtype`: a canonical
    name; None (or `block_size` None): unknown, which `strict=False` (auto's question) also refuses."""
    if device not in row.devices:
        where = "the CPU" if row.devices == ("cpu",) else "CUDA devices"
        return f"it runs only on {where} and the device is {device!r} (use 'torch' or 'auto')"
    if dtype is None and not strict and row.dtypes != DTYPES:
        return "the dtype is unknown"
    if dtype is not None and dtype not in row.dtypes:
        return f"its kernels support {_words(row.dtypes)} only; the dtype is {dtype}"
    if row.block_multiple > 1:
        if block_size is None and not strict:
            return "the KV block size is unknown"
        if block_size is not None and block_size % row.block_multiple != 0:
            return (
                f"its paged kernels read a KV cache only when block_size is a multiple of "
                f"{row.block_multiple}; block_size is {block_size}"
            )
    return None


def auto_candidates(device: str, dtype: str | None, block_size: int | None) -> tuple[tuple[str, ...], list[str]]:
    """`auto`'s candidates for this configuration in order of preference, by the rows alone, ending with the
    fallback; and why the others were passed over."""
    chosen: list[str] = []
    passed_over: list[str] = []
    for row in auto_rows(device):
        reason = static_reason(row, device, dtype, block_size, strict=False)
        if reason is None:
            chosen.append(row.name)
        else:
            passed_over.append(f"not {row.name}: {reason}")
    return (*chosen, FALLBACK), passed_over


def auto_rows(device: str) -> list[BackendRow]:
    """The rows `auto` may pick on `device`, in its order of preference (the fallback not among them)."""
    rows = [r for r in BACKENDS.values() if r.auto_rank is not None and device in r.devices]
    return sorted(rows, key=lambda r: r.auto_rank or 0)


def never_auto(device: str) -> list[str]:
    """Why `auto` never picks some of the backends that run on `device` (said in auto's log line)."""
    rows = [r for r in BACKENDS.values() if r.not_auto and device in r.devices]
    return [f"{r.name} is never picked by auto: {r.not_auto}" for r in rows]


def _words(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
