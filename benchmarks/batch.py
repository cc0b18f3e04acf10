"""Batch throughput: `raytp batch` at 1 and 2 replicas against `LLM.generate` on the same requests.

Workload: `--rows` completion rows on the embedded model (or `--model`), prompts "Row i: ..." of a
few words, `--max-tokens` output tokens each, greedy, ignore_eos (every row costs the same tokens).
Each batch run is a fresh job (new output dir, so no journal is reused) on one local Ray; its wall
time includes starting the replicas' engines, as a user's job pays it, and is also shown less one
engine load (measured by LLM's own start). Prints rows/s and output tokens/s per mode and the batch
layer's cost relative to LLM.generate at 1 replica.

    python benchmarks/batch.py --rows 256 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import ray

from cluster.config import EngineConfig
from raytp.batch.runner import BatchJob, run_batch


def rows(n: int, max_tokens: int) -> list[dict[str, object]]:
    return [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"Row {i}: tell me something.", "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True},
        }
        for i in range(n)
    ]  # fmt: skip


def run_llm(engine: EngineConfig, data: list[dict[str, object]], max_tokens: int) -> tuple[float, float]:
    """(seconds for generate alone, seconds to load the engine)."""
    from raytp import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**{k: v for k, v in vars(engine).items()})
    load = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [str(r["body"]["prompt"]) for r in data]  # type: ignore[index]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - t0
    llm.llm_engine.shutdown()
    return took, load


def run_job(engine: EngineConfig, data: list[dict[str, object]], replicas: int, concurrency: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in data))
        job = BatchJob(str(src), str(Path(d) / "out.jsonl"), None, engine, num_replicas=replicas,
                       batch_size=concurrency, show_progress=False)  # fmt: skip
        t0 = time.perf_counter()
        status = run_batch(job)
        took = time.perf_counter() - t0
        assert status.completed == len(data), status.to_dict()
        return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=256, help="rows per replica in flight")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray")
    args = ap.parse_args()
    engine = EngineConfig(model=args.model, max_model_len=512, kv_cache_memory_bytes=1 << 30, swap_space=0.5)
    data = rows(args.rows, args.max_tokens)
    tokens = args.rows * args.max_tokens
    gen, load = run_llm(engine, data, args.max_tokens)
    print(f"LLM.generate          : {args.rows / gen:8.2f} rows/s {tokens / gen:9.1f} out tok/s "
          f"({gen:.1f} s; engine load {load:.1f} s not counted)")  # fmt: skip
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    for n in args.replicas:
        took = run_job(engine, data, n, args.max_concurrency)
        net = max(took - load, 1e-9)  # the job starts its replicas' engines; one load is subtracted
        print(f"raytp batch {n} replica(s): {args.rows / took:8.2f} rows/s {tokens / took:9.1f} out tok/s "
              f"({took:.1f} s whole job; {tokens / net:.1f} out tok/s less one engine load)")  # fmt: skip
        if n == 1:
            print(f"  batch layer cost at 1 replica (vs generate, engine load excluded): {net / gen - 1:+.1%}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
