"""One mixture-of-experts layer on the CPU: raytp's `SparseMoeBlock` against transformers' on the same weights.

    python -m benchmarks.moe_layer [--tokens 1 16 256] [--iters 7] [--threads 2]

Mixtral-like shapes scaled to fit a small machine: hidden 1024, 8 experts, top-2, expert intermediate
2816 (Mixtral-8x7B's ratio of 3.5; 35 MB of fp32 weights per expert, 277 MB per layer), fp32. Random
weights and inputs; the router's weights are scaled so every expert gets tokens. Variants, milliseconds
per call (median and min of `--iters` rounds after one warm-up; each round runs every variant once):

    raytp panels      SparseMoeBlock after pack_weights() (the engine's default on the CPU)
    raytp dense       SparseMoeBlock unpacked: the same grouping, F.linear per expert
    padded bmm        the same routing, tokens padded per expert into [E, max_rows, H], torch.bmm over all
                      experts (the batched alternative to the loop over experts)
    HF <impl>         transformers' MixtralSparseMoeBlock with `experts_implementation` eager (a loop
                      over experts, index_add_), grouped_mm (its default for a loaded model: sorted tokens,
                      torch's grouped GEMM) and batched_mm (each token's expert weights gathered, bmm;
                      run only up to 16 tokens: it copies 35 MB of weights per token and choice)

Each variant's output is checked against HF eager's before it is timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model_exec.layers.moe import FusedMoE, SparseMoeBlock, select_experts
from model_exec.parallel import TPGroup

HIDDEN, EXPERTS, TOP_K, INTER = 1024, 8, 2, 2816
BATCHED_MM_MAX_TOKENS = 16


def hf_block(implementation: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config).eval()
    block.load_state_dict(state)
    return block


def raytp_block(state: dict[str, torch.Tensor], panels: bool) -> SparseMoeBlock:
    block = SparseMoeBlock(FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, True, TPGroup.single(), torch.float32))
    block.gate.weight.data.copy_(state["gate.weight"])
    experts = block.experts
    for e in range(EXPERTS):
        gate, up = state["experts.gate_up_proj"][e].chunk(2)
        experts.weight_loader(experts.gate_up_proj, gate, (e, "gate"))
        experts.weight_loader(experts.gate_up_proj, up, (e, "up"))
        experts.weight_loader(experts.down_proj, state["experts.down_proj"][e], (e, "down"))
    if panels and not (block.gate.pack_weights() and experts.pack_weights()):
        raise RuntimeError("the panel kernel is not available on this machine")
    return block


def padded_bmm(state: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    gate_w, w13, w2 = state["gate.weight"], state["experts.gate_up_proj"], state["experts.down_proj"]

    def forward(x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(F.linear(x, gate_w), TOP_K, True)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=EXPERTS)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(flat.numel()) - starts[flat[order]]  # row of each choice within its expert
        padded = x.new_zeros(EXPERTS, int(counts.max()), HIDDEN)
        padded[flat[order], slot] = x[order // TOP_K]
        h = torch.bmm(padded, w13.transpose(1, 2))
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))[flat[order], slot]
        y *= weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, order // TOP_K, y)

    return forward


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=(1, 16, 256))
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    state = {
        "gate.weight": torch.randn(EXPERTS, HIDDEN) / HIDDEN**0.5,
        "experts.gate_up_proj": torch.randn(EXPERTS, 2 * INTER, HIDDEN) / HIDDEN**0.5,
        "experts.down_proj": torch.randn(EXPERTS, HIDDEN, INTER) / INTER**0.5,
    }
    hf = {impl: hf_block(impl, state) for impl in ("eager", "grouped_mm", "batched_mm")}
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "raytp panels": raytp_block(state, panels=True),
        "raytp dense": raytp_block(state, panels=False),
        "padded bmm": padded_bmm(state),
        **{f"HF {impl}": (lambda x, b=block: b(x[None])[0]) for impl, block in hf.items()},
    }
    print(f"hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, intermediate {INTER}, fp32, {args.threads} threads")
    print("ms per call, median (min) of", args.iters, "\n")
    print(f"{'variant':<16}" + "".join(f"{f'T={t}':>20}" for t in args.tokens))
    rows: dict[str, list[str]] = {name: [] for name in variants}
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN)
        ref = hf["eager"](x[None])[0]
        runs = {n: f for n, f in variants.items() if n != "HF batched_mm" or tokens <= BATCHED_MM_MAX_TOKENS}
        for name, fn in runs.items():  # also the warm-up
            torch.testing.assert_close(fn(x), ref, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.iters):  # round-robin, so a busy moment of a shared machine hits every variant
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn(x)
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name in variants:
            cell = f"{statistics.median(times[name]):9.2f} ({min(times[name]):7.2f})" if name in times else "n/a"
            rows[name].append(cell)
    for name, cells in rows.items():
        print(f"{name:<16}" + "".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
