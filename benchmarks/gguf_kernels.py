"""The weight products of one forward pass, kernel against kernel: fp32 panels vs the GGUF block kernels
(Q4_1, Q8_0 = the int8 quantization's blocks, Q4_K, Q6_K, and the Q4_K_M mix), interleaved rounds in one process.

    PYTHONPATH=. python benchmarks/gguf_kernels.py [--tokens 1 128] [--threads 1] [--rounds 9]
        [--types Q4_1 Q8_0] [--int-road] [--smollm2] [--clock thread]

`--int-road` adds, for each type, the integer tiles forced at every row count (RAYTP_GGUF_DEQUANT_ROWS set
past the tokens), so a prefill shape times both roads of gguf_gemm.cpp side by side.

`--smollm2` takes SmolLM2-135M's own shapes instead (576 wide: QKV 960x576, o 576x576, gate/up 3072x576, down
576x1536, head 49152x576; the 32-block types only). `--clock thread` times with `time.thread_time` (this thread's
CPU time: robust to other processes' time slices on a shared machine, meaningful at `--threads 1` only).

Shapes: the 512-wide SmolLM2-sized Llama of benchmarks/kquant_model.py (SmolLM2's 576 is not a multiple of
a K-quant super-block): per layer fused QKV 1024x512, o_proj 512x512, fused gate/up 3072x512, down 512x1536,
30 layers, plus the 49152x512 LM head. Random weights; the 32-block types quantized by the `gguf` package,
the K-quants by tests/helpers/kquants.py. Q4_K_M: Q6_K for the head (tied token_embd), v rows and down,
Q4_K for the rest (the fused QKV then runs as two segments, as the engine runs it). Each round times every
variant once, in turn; the medians and minima over rounds are printed, in ms per pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

LAYER = {"qkv": (1024, 512), "o": (512, 512), "gate_up": (3072, 512), "down": (512, 1536)}
HEAD = (49152, 512)
SMOLLM2_LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SMOLLM2_HEAD = (49152, 576)
V_ROWS = 256  # of the fused QKV: q 512, k 256, v 256


def _blocks(w: torch.Tensor, qtype: int) -> torch.Tensor:
    from gguf.quants import quantize

    from tests.helpers.kquants import quantize_kquant

    array = w.numpy()
    raw = quantize_kquant(array, qtype) if qtype in (12, 14) else quantize(array, qtype)
    return torch.from_numpy(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=(1, 128))
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q4_K_M mix"])
    ap.add_argument("--int-road", action="store_true", help="also time the integer tiles at every row count")
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M's 576-wide shapes (Q4_1, Q8_0, Q4_0 only)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    args = ap.parse_args()
    if args.smollm2 and any(t in ("Q4_K", "Q6_K", "Q4_K_M mix") for t in args.types):
        ap.error("--smollm2: 576 is not a multiple of a K-quant super-block (256); pass --types Q4_1 Q8_0")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    layer_shapes, head_shape = (SMOLLM2_LAYER, SMOLLM2_HEAD) if args.smollm2 else (LAYER, HEAD)
    torch.set_num_threads(args.threads)

    from model_exec.layers import cpu_gemm
    from model_exec.layers.quantization.gguf import gguf_linear
    from ops.attention import cpu_kernels

    error = cpu_kernels.load_error()
    assert error is None, error

    torch.manual_seed(0)
    mats = [(name, torch.randn(*shape) * 0.02) for _ in range(args.layers) for name, shape in layer_shapes.items()]
    mats.append(("head", torch.randn(*head_shape) * 0.02))
    panels = [(cpu_gemm.pack_panels(w), w.shape[0]) for _, w in mats]

    def uniform(qtype: int) -> list[list[tuple[int, torch.Tensor]]]:
        return [[(qtype, _blocks(w, qtype))] for _, w in mats]

    def q4_k_m() -> list[list[tuple[int, torch.Tensor]]]:
        segs: list[list[tuple[int, torch.Tensor]]] = []
        for name, w in mats:
            if name == "qkv":
                segs.append([(12, _blocks(w[:-V_ROWS], 12)), (14, _blocks(w[-V_ROWS:], 14))])
            else:
                segs.append(
                    [(14 if name in ("down", "head") else 12, _blocks(w, 14 if name in ("down", "head") else 12))]
                )
        return segs

    makers = {"Q4_0": lambda: uniform(2), "Q4_1": lambda: uniform(3), "Q8_0": lambda: uniform(8)}
    makers |= {"Q4_K": lambda: uniform(12)}
    makers |= {"Q6_K": lambda: uniform(14), "Q4_K_M mix": q4_k_m}
    variants = {name: makers[name]() for name in args.types}
    print(f"threads={torch.get_num_threads()}, {len(mats)} matrices, rounds={args.rounds}, clock={args.clock}")
    with torch.inference_mode():
        for m in args.tokens:
            xs = {k: torch.randn(m, k) for k in {w.shape[1] for _, w in mats}}

            def fp32(xs: dict[int, torch.Tensor] = xs) -> None:
                for (p, n), (_, w) in zip(panels, mats, strict=True):
                    cpu_gemm.panel_linear(xs[w.shape[1]], p, n, None)

            def blocks(
                segs: list[list[tuple[int, torch.Tensor]]], xs: dict[int, torch.Tensor] = xs, int_road: bool = False
            ) -> Callable[[], None]:
                def run() -> None:
                    os.environ["RAYTP_GGUF_DEQUANT_ROWS"] = str(1 << 30) if int_road else "0"
                    for layer, (_, w) in zip(segs, mats, strict=True):
                        outs = [gguf_linear(xs[w.shape[1]], raw, qtype) for qtype, raw in layer]
                        if len(outs) > 1:
                            torch.cat(outs, dim=-1)
                    os.environ.pop("RAYTP_GGUF_DEQUANT_ROWS")

                return run

            runs = {"fp32 panels": fp32, **{name: blocks(segs) for name, segs in variants.items()}}
            if args.int_road:
                runs |= {f"{name} int": blocks(segs, int_road=True) for name, segs in variants.items()}
            for fn in runs.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, fn in runs.items():
                    t0 = clock()
                    fn()
                    times[name].append((clock() - t0) * 1e3)
            base = statistics.median(times["fp32 panels"])
            for name, ts in times.items():
                med = statistics.median(ts)
                print(
                    f"tokens={m:4d} {name:>14}: median {med:8.1f} ms  min {min(ts):8.1f} ms  x{base / med:.2f} of fp32"
                )


if __name__ == "__main__":
    main()
