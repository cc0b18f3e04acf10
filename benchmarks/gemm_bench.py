"""The linear layers of one forward pass, `F.linear` (MKL) vs oneDNN-prepacked weights vs panels.

    python -m benchmarks.gemm_bench [--tokens 1 64 512] [--threads 2]
    python -m benchmarks.gemm_bench --tokens 1 2 6 16 64 256 512 --skip-dense   # panels vs oneDNN

Random fp32 matrices at SmolLM2-135M's shapes (per layer: fused QKV 960x576, o_proj 576x576,
fused gate/up 3072x576, down 576x1536; 30 layers) plus the 49152x576 LM head. Prints the
milliseconds of one pass (min and median of `--iters`) and the weight bytes read per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model_exec.layers import cpu_gemm

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LM_HEAD = (49152, 576)


def time_pass(fn: Callable[[], None], iters: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=(1, 64, 512))
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-dense", action="store_true", help="leave out F.linear (MKL)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(*shape) for _ in range(args.layers) for shape in LAYER_SHAPES]
    weights.append(torch.randn(*LM_HEAD))
    packed = [cpu_gemm.pack_weight(w) for w in weights]
    panels = [cpu_gemm.pack_panels(w) for w in weights] if cpu_gemm.can_use_panels(weights[0]) else None
    total_bytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"threads={torch.get_num_threads()}, {len(weights)} matrices, {total_bytes / 1e6:.0f} MB of weights")
    with torch.inference_mode():
        for m in args.tokens:
            inputs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}

            def dense(m: int = m, inputs: dict[int, torch.Tensor] = inputs) -> None:
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)

            def onednn(m: int = m, inputs: dict[int, torch.Tensor] = inputs) -> None:
                for w, p in zip(weights, packed, strict=True):
                    cpu_gemm.packed_linear(inputs[w.shape[1]], p, None)

            def panel(m: int = m, inputs: dict[int, torch.Tensor] = inputs) -> None:
                assert panels is not None
                for w, p in zip(weights, panels, strict=True):
                    cpu_gemm.panel_linear(inputs[w.shape[1]], p, w.shape[0], None)

            runs = [] if args.skip_dense else [("F.linear", dense)]
            runs.append(("oneDNN packed", onednn))
            if panels is not None:
                runs.append(("panels", panel))
            for name, fn in runs:
                best, med = time_pass(fn, args.iters)
                print(
                    f"tokens={m:5d} {name:>14}: min {best * 1e3:8.1f} ms  median {med * 1e3:8.1f} ms  "
                    f"{total_bytes / best / 1e9:5.1f} GB/s"
                )


if __name__ == "__main__":
    main()
