"""The linear layers of one forward pass, `F.linear` (MKL) vs oneDNN-prepacked weights vs panels.

    python -m benchmarks.gemm_bench [--tokens 1 64 512] [--threads 2]
    python -m benchmarks.gemm_bench --tokens 1 16 64 256 512 --skip-dense   # panels vs oneDNN
    python -m benchmarks.gemm_bench --tokens 16 256 --skip-dense --baseline main   # + main's panel kernel

Random fp32 matrices at SmolLM2-135M's shapes (per layer: fused QKV 960x576, o_proj 576x576,
fused gate/up 3072x576, down 576x1536; 30 layers) plus the 49152x576 LM head. The kernels run
interleaved, round by round (alternating their order), so a neighbour's load falls on all of them
alike; prints the milliseconds of one pass (min and median of `--iters` rounds) and the weight bytes
read per second. `--cpu-time` times the calling thread's CPU time instead of the wall clock: with
`--threads 1` a kernel's own speed, nearly blind to other processes on a shared machine.
`--baseline REF` also builds `ops/csrc/panel_gemm.cpp` as of git REF (~30 s) and times it as
`panels@REF`, for A/B of a kernel change in one process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from model_exec.layers import cpu_gemm
from ops.attention import cpu_kernels

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LM_HEAD = (49152, 576)


def load_baseline(ref: str) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """REF's panel_linear, built from `git show REF:ops/csrc/panel_gemm.cpp` under the op namespace
    `raytp_baseline` (the running library keeps `raytp_cpu`)."""
    from torch.utils import cpp_extension

    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{ref}:ops/csrc/panel_gemm.cpp"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    build = Path(tempfile.mkdtemp(prefix="panel_baseline_"))
    (build / "panel_gemm.cpp").write_text(source.replace("(raytp_cpu,", "(raytp_baseline,"))
    header = subprocess.run(
        ["git", "show", f"{ref}:ops/csrc/vec_math.h"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    (build / "vec_math.h").write_text(header)
    _, flags = cpu_kernels._isa_flags()
    cpp_extension.load(
        name="panel_baseline",
        sources=[str(build / "panel_gemm.cpp")],
        extra_cflags=["-O3", "-fopenmp", *flags],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        is_python_module=False,
    )
    return torch.ops.raytp_baseline.panel_linear


def time_rounds(fns: dict[str, Callable[[], None]], rounds: int, clock: Callable[[], float]) -> dict[str, list[float]]:
    """Seconds per call of every fn, one call each per round, the order reversed every other round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=(1, 64, 512))
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--iters", type=int, default=9, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-dense", action="store_true", help="leave out F.linear (MKL)")
    ap.add_argument("--cpu-time", action="store_true", help="the calling thread's CPU time, not the wall clock")
    ap.add_argument("--baseline", metavar="REF", help="also time panel_gemm.cpp as of this git ref")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(*shape) for _ in range(args.layers) for shape in LAYER_SHAPES]
    weights.append(torch.randn(*LM_HEAD))
    packed = [cpu_gemm.pack_weight(w) for w in weights]
    panels = [cpu_gemm.pack_panels(w) for w in weights] if cpu_gemm.can_use_panels(weights[0]) else None
    baseline = load_baseline(args.baseline) if args.baseline and panels is not None else None
    total_bytes = sum(w.numel() * w.element_size() for w in weights)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(
        f"threads={torch.get_num_threads()}, {len(weights)} matrices, {total_bytes / 1e6:.0f} MB of weights, "
        f"{'thread CPU time' if args.cpu_time else 'wall clock'}, {args.iters} interleaved rounds"
    )
    with torch.inference_mode():
        for m in args.tokens:
            inputs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
            fns: dict[str, Callable[[], None]] = {}

            def dense(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)

            def onednn(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for w, p in zip(weights, packed, strict=True):
                    cpu_gemm.packed_linear(inputs[w.shape[1]], p, None)

            def panel(inputs: dict[int, torch.Tensor] = inputs) -> None:
                assert panels is not None
                for w, p in zip(weights, panels, strict=True):
                    cpu_gemm.panel_linear(inputs[w.shape[1]], p, w.shape[0], None)

            def panel_baseline(inputs: dict[int, torch.Tensor] = inputs) -> None:
                assert panels is not None and baseline is not None
                for w, p in zip(weights, panels, strict=True):
                    baseline(inputs[w.shape[1]], p, w.shape[0])

            if not args.skip_dense:
                fns["F.linear"] = dense
            fns["oneDNN packed"] = onednn
            if panels is not None:
                fns["panels"] = panel
                if baseline is not None:
                    for w, p in zip(weights, panels, strict=True):  # a kernel change must not move a bit
                        x = inputs[w.shape[1]]
                        assert torch.equal(baseline(x, p, w.shape[0]), cpu_gemm.panel_linear(x, p, w.shape[0], None))
                    fns[f"panels@{args.baseline}"] = panel_baseline
            for name, ts in time_rounds(fns, args.iters, clock).items():
                best, med = min(ts), statistics.median(ts)
                print(
                    f"tokens={m:5d} {name:>14}: min {best * 1e3:8.1f} ms  median {med * 1e3:8.1f} ms  "
                    f"{total_bytes / best / 1e9:5.1f} GB/s"
                )


if __name__ == "__main__":
    main()
