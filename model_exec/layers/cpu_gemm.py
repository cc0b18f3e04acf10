"""The fp32 CPU linear layers: raytp's panel GEMM (default) or oneDNN-prepacked weights.

`F.linear` on the CPU goes to MKL, which reads an `[out, in]` weight at ~10-12 GB/s on this
project's AMD machines (MKL picks generic code paths on non-Intel CPUs). Both layouts here beat it.

**Panels** (`EngineConfig.cpu_panel_gemm`, on by default): every weight is repacked once into
16-wide panels (`pack_panels`: `[ceil(out / 16), in, 16]`) and `ops/csrc/panel_gemm.cpp` computes
every batch size from them: tiles of many rows for prefill chunks and large decode batches, few rows
across several panels for a decode step of one or two sequences, where the time is streaming the
weight once and the panel layout makes that one sequential read. Every output element is one FMA
chain over the input features in order, whatever the batch, so a row's result does not depend on
how many rows share its step (the batch jobs' byte-identical re-runs rely on that, tests/batch).
With AVX-512, a call of 12+ rows packs x into 12-row k-major strips and its threads claim chunks of
panels one at a time (robust to another process taking a core for a few ms); fewer rows keep the
decode tiles and the static split.

Measured on 2 cores, SmolLM2-135M's 121 matrices (layers and LM head), one pass, ms: medians of 6
rounds of a scratch script that alternated the two kernels round by round (1-6 rows in one run,
16-512 in another), on this project's Zen 4 VMs, with the kernel before x was packed into strips (not
re-measured there since):

    rows       1     2     6    16    64   256   512
    oneDNN   30.4  31.5  25.9  38.3  112   393   771
    panels   18.5  18.0  24.4  38.8  104   404   823

On the 2-core Sapphire Rapids VM (AVX-512, no AMX), one thread's CPU time (the machine was shared,
load average 4-8: a thread's CPU time is the figure that holds), medians of 9 interleaved rounds,
`python -m benchmarks.gemm_bench --tokens 1 2 6 16 64 256 512 --skip-dense --threads 1 --cpu-time
--baseline main` (main: the kernel before the strips and the claimed chunks):

    rows        1     2     6    16    64   256   512
    oneDNN    46.6  49.6  57.0  74.9  154   579   1033   (min 256: 501, 512: 993)
    main      35.3  38.5  37.8  49.8  144   606   1146   (min 581, 1134)
    panels    35.7  38.8  38.1  50.6  137   549   1069   (min 523, 1059)

so from 256 rows up the panels are still 3-7% behind oneDNN on one Intel core; the served, two-thread
figure is `python -m benchmarks.gemm_bench --tokens 1 16 64 256 512 --skip-dense` on the idle machine.

The bulk tiles use AVX-512 where the CPU has it and AVX2 otherwise, with the same bits; on AVX2 alone
they are 5-20% slower than oneDNN from 16 rows up.

**oneDNN** (`cpu_panel_gemm=False`, or the panel kernel not built): the weight reordered once into
oneDNN's blocked layout. The packing hint (batch size) is left unset: measured, it is the best
single layout for every batch size from 1 to 2048 tokens. Each output row depends on its own input
row only here too. The packed tensor is an opaque `torch._mkldnn` tensor: it can only be passed to
`packed_linear`; the layer keeps what it needs (shape) on the side.

Either way a layer holds one packed copy and releases its dense weight.

**Gated MLPs** (`panel_linear_silu_mul`, through `GateUpParallelLinear.silu_and_mul`): with AVX-512 one
kernel runs the fused gate/up projection and SiLU-and-mul, each tile holding a gate panel and its up
panel and storing silu(gate) * up, so the [T, 2 * intermediate] product is never written (a prefill
chunk's 25 MB at SmolLM2's sizes). Same FMA chains, same SiLU code, same bits as the two steps. In
the offline workload's prefill steps it runs at ~500 GFLOP/s, ~96% of two Zen 5 cores' FMA peak
(torch.profiler, `python -m benchmarks.step_profile --workload offline --num-prompts 96 --profile torch
--profile-steps 0 12`).

**Dense, MKL** (`mkl_fast_paths`): a model whose steps are thousands of rows (the BERT-family encoders'
pooling steps, `dense_cpu_gemm` in models/bert.py) keeps its dense weights on an Intel CPU, where torch's
MKL runs its AVX-512 kernels: there, at 4,608-5,671 rows, MKL measured ~15% faster per encoder layer than
the panels and ~8% faster than oneDNN's layout (docs/benchmarks.md "embedding").

The panels sit on transparent huge pages (`model_exec.huge_pages`): a decode step streams all of them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from model_exec import huge_pages
from ops.attention import cpu_kernels

PANEL = 16  # output features per panel (ops/csrc/panel_gemm.cpp's kPanel)


@functools.cache
def mkl_fast_paths() -> bool:
    """True when torch multiplies through MKL on an Intel CPU (MKL dispatches its AVX-512 kernels on Intel
    CPUs only; on AMD it takes generic paths and the panels win)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            head = f.read(4096)
    except OSError:
        return False
    return "GenuineIntel" in head


def can_pack(weight: torch.Tensor) -> bool:
    """True when `weight` is an fp32 CPU matrix and this torch build has oneDNN's linear ops."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`[out, in]` fp32 weight -> oneDNN's blocked layout (a copy; the caller may free the original)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias with W prepacked by `pack_weight`; x is [..., in]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def can_use_panels(weight: torch.Tensor) -> bool:
    """True when `weight` is an fp32 CPU matrix and the panel kernel is loaded with its AVX2 path."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and cpu_kernels.load_error() is None
        and cpu_kernels.vectorized()
    )


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`[out, in]` -> `[ceil(out / 16), in, 16]`: 16 output features side by side per input feature,
    the last panel zero-padded (a copy, on huge pages where Linux has them)."""
    out_features, in_features = weight.shape
    groups = -(-out_features // PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, groups * PANEL - out_features))
    panels = padded.view(groups, PANEL, in_features).transpose(1, 2).contiguous()
    huge_pages.advise(panels, collapse=True)  # every decode step streams all of them
    return panels


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias for x [..., in] with W packed by `pack_panels`."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    y = torch.ops.raytp_cpu.panel_linear(rows if rows.stride(-1) == 1 else rows.contiguous(), panels, out_features)
    if bias is not None:
        y.add_(bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)


def panel_linear_silu_mul(x: torch.Tensor, panels: torch.Tensor, half: int) -> torch.Tensor:
    """silu(gate) * up for x [..., in] and W = [W_gate; W_up] packed by `pack_panels` (each `half` rows,
    a multiple of 16): one kernel, the [..., 2 * half] product never written; the bits of `panel_linear`
    followed by `ops.fused.silu_and_mul`."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    y = torch.ops.raytp_cpu.panel_linear_silu_mul(rows if rows.stride(-1) == 1 else rows.contiguous(), panels, half)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], half)


def pack(weight: torch.Tensor, panels: bool) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """(panel copy, oneDNN copy) of `weight`, exactly one set: panels when `panels` and the kernel is
    built, else oneDNN's layout; None when neither can run this weight (it stays dense)."""
    if panels and can_use_panels(weight):
        return pack_panels(weight), None
    if can_pack(weight):
        return None, pack_weight(weight)
    return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    panel_weight: torch.Tensor | None,
    packed_weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x @ W^T + bias from whichever copy `pack` made (`weight` is read only when neither exists)."""
    if panel_weight is not None:
        return panel_linear(x, panel_weight, weight.shape[0], bias)
    if packed_weight is not None:
        return packed_linear(x, packed_weight, bias)
    return F.linear(x, weight, bias)
