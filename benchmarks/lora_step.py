"""What LoRA adds to one decode step: the embedded SmolLM2-135M's model runner on the CPU (fp32, panel GEMMs).

    python -m benchmarks.lora_step [--rows 64] [--context 128] [--adapters 4] [--rank 16] [--rounds 15]

One decode step of `--rows` sequences, each with `--context` tokens already in its KV cache, through
`ModelRunner.execute` (inputs, forward, logits, greedy sampling), in three variants:

    base            the model built without enable_lora (no LoRA slots at all)
    lora, unused    enable_lora with the adapters loaded, every row on the base model
    lora, N         the same rows spread round-robin over N adapters (rank `--rank`, every projection targeted:
                    q, k, v, o, gate, up, down); the runner groups the rows by adapter

The adapters are random PEFT checkpoints written to a temporary folder (adapter_config.json +
adapter_model.safetensors, PEFT's names and shapes) and loaded through `LoRAManager.add`, as a worker does.
Rounds are interleaved (each round times every variant once, in the reverse order of the round before, so a busy
moment of a shared machine hits all of them); milliseconds per step, median and min over `--rounds` after three
warm-up rounds, and each one's ratio to `base`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from model_exec.config import ModelConfig
from model_exec.lora.manager import LoRAManager
from model_exec.model_runner import ModelRunner
from model_exec.parallel import TPGroup
from request.lora import LoRARequest
from request.sampling_params import SamplingParams
from scheduler.outputs import CachedSeqData, NewSeqData, SchedulerOutput
from tests.helpers.tiny_models import make_kv_caches

BLOCK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, config: ModelConfig, rank: int, seed: int) -> str:
    """A random PEFT LoRA checkpoint for `config`'s model at `path` (every projection of every layer)."""
    h, q, kv, inter = (
        config.hidden_size,
        config.q_size,
        config.num_key_value_heads * config.head_dim,
        config.intermediate_size,
    )
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for target, (n_in, n_out) in shapes.items():
            group = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{group}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) / rank**0.5 * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}, f)
    return path


def load_model(attention_backend: str) -> tuple[torch.nn.Module, ModelConfig]:
    """The embedded model's weights on the CPU, fp32, packed as the engine packs them."""
    from model_exec.models import build_model, pack_weights
    from model_exec.source import read_model_config, resolve_model
    from model_exec.weights import iter_weights
    from ops.attention import get_attn_backend

    src = resolve_model(None)
    config = read_model_config(src)
    backend = get_attn_backend(attention_backend, torch.device("cpu"), torch.float32, BLOCK)
    net = build_model(config, TPGroup.single(), backend, "cpu", torch.float32)
    net.load_weights(iter_weights(src))
    pack_weights(net)
    return net, config  # type: ignore[return-value]


class Variant:
    """A runner with its own KV cache, its rows prefilled up to their last context token."""

    def __init__(self, net: torch.nn.Module, config: ModelConfig, lora: LoRAManager | None, lora_ids: list[int],
                 context: int) -> None:  # fmt: skip
        self.runner = ModelRunner(net, TPGroup.single(), BLOCK, torch.device("cpu"), (), lora)  # type: ignore[arg-type]
        blocks = -(-context // BLOCK)
        self.caches = make_kv_caches(config, 1, 1 + len(lora_ids) * blocks, BLOCK, torch.float32, "cpu")
        greedy = SamplingParams(temperature=0.0)
        gen = torch.Generator().manual_seed(1)
        new = [
            NewSeqData(seq_id=s, token_ids=torch.randint(100, 49000, (context,), generator=gen).tolist(),
                       num_prompt_tokens=context, block_ids=list(range(1 + s * blocks, 1 + (s + 1) * blocks)),
                       num_computed_tokens=0, num_scheduled_tokens=context - 1, sampling_params=greedy, seed=s,
                       sample_index=0, lora_id=lora_id)
            for s, lora_id in enumerate(lora_ids)
        ]  # fmt: skip
        self.runner.execute(SchedulerOutput(new_seqs=new), self.caches)
        # the timed step: every row's last context token, sampled; repeating it rewrites the same KV slots
        decodes = [CachedSeqData(s, [], blocks, [], context - 1, 1) for s in range(len(lora_ids))]
        self.step = SchedulerOutput(cached_seqs=decodes, num_samples=dict.fromkeys(range(len(lora_ids)), 1))

    def run(self) -> float:
        t0 = time.perf_counter()
        self.runner.execute(self.step, self.caches)
        return (time.perf_counter() - t0) * 1e3


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base_net, config = load_model(args.attention_backend)
    lora_net, _ = load_model(args.attention_backend)
    manager = LoRAManager(lora_net, max_loras=args.adapters, max_lora_rank=args.rank)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1, args.adapters + 1):
            manager.add(LoRARequest(f"a{i}", i, write_adapter(os.path.join(tmp, f"a{i}"), config, args.rank, i)))
    spread = [1 + r % args.adapters for r in range(args.rows)]
    variants = {
        "base": Variant(base_net, config, None, [0] * args.rows, args.context),
        "lora, unused": Variant(lora_net, config, manager, [0] * args.rows, args.context),
        f"lora, {args.adapters}": Variant(lora_net, config, manager, spread, args.context),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(3):  # warm-up
        for v in variants.values():
            v.run()
    order = list(variants.items())
    for _ in range(args.rounds):  # every round times each variant once, in the reverse order of the last
        order.reverse()
        for name, v in order:
            times[name].append(v.run())
    base, base_min = statistics.median(times["base"]), min(times["base"])
    print(f"SmolLM2-135M (embedded), fp32 CPU, {args.threads} threads: one decode step of {args.rows} rows, "
          f"context {args.context}; {args.adapters} adapters of rank {args.rank} on q,k,v,o,gate,up,down")  # fmt: skip
    print(f"ms per step, median (min) of {args.rounds} interleaved rounds\n")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<16}{med:9.2f} ({min(t):7.2f})   x{med / base:.3f} (min x{min(t) / base_min:.3f})")


if __name__ == "__main__":
    main()
