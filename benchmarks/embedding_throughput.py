"""Embedding throughput: raytp's pooling runner against sentence-transformers' `encode`, same model folder.

A BERT-base-shaped encoder (12 layers, hidden 768, 12 heads, FFN 3072, vocab 30522; random weights)
saved as a sentence-transformers folder (mean pooling + Normalize); `--num-texts` texts of 32-256 tokens
(seeded). Both sides run in this process with the same torch threads; sentence-transformers' batch size
equals raytp's `max_num_seqs`. Each side first embeds 8 texts untimed (one-time costs); rounds alternate
(A, B, A, B, ...) so machine noise hits both; the medians are reported, with the cosine agreement of the two
sides' vectors. `--threads` sets torch's threads for both (default: torch's own, the cores); the process's
CPU time per side is printed beside the wall time: with `--threads 1` on a shared machine it is the
reading other processes do not distort (they take the core away, they do not slow it), though it also
counts the engine's own host threads.

    python -m benchmarks.embedding_throughput --num-texts 1000 --batch-size 32 --rounds 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _texts(num: int, seed: int) -> list[str]:
    from tests.helpers.tiny_pooling import VOCAB

    words = [w for w in VOCAB if not w.startswith(("[", "##")) and len(w) > 1]
    rng = random.Random(seed)
    # each word is one token; [CLS] and [SEP] make 32 .. 256 tokens
    return [" ".join(rng.choice(words) for _ in range(rng.randint(30, 254))) for _ in range(num)]


def _model(root: Path) -> str:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel

    from tests.helpers.tiny_pooling import save_wordpiece_tokenizer

    config = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    hf_dir = root / "bert-base-random"
    BertModel(config).eval().save_pretrained(str(hf_dir))
    save_wordpiece_tokenizer(hf_dir)
    out = root / "st"
    SentenceTransformer(modules=[Transformer(str(hf_dir)), Pooling(768, pooling_mode="mean"), Normalize()],
                        device="cpu").save(str(out))  # fmt: skip
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-texts", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch threads for both sides (default: torch's)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from raytp import LLM

    texts = _texts(args.num_texts, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = _model(Path(tmp))
        st = SentenceTransformer(path, device="cpu")
        llm = LLM(path, runner="pooling", max_num_seqs=args.batch_size,
                  max_num_batched_tokens=args.batch_size * 256)  # fmt: skip
        num_tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in texts)
        st.encode(texts[:8], batch_size=args.batch_size)  # untimed: one-time costs (allocations, first-call setup)
        llm.embed(texts[:8], use_tqdm=False)
        st_times, ours_times, st_cpu, ours_cpu = [], [], [], []
        ref = ours = np.zeros(0)
        for _ in range(args.rounds):
            start, cpu = time.perf_counter(), time.process_time()
            ref = st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True)
            st_times.append(time.perf_counter() - start)
            st_cpu.append(time.process_time() - cpu)
            start, cpu = time.perf_counter(), time.process_time()
            ours = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
            ours_times.append(time.perf_counter() - start)
            ours_cpu.append(time.process_time() - cpu)
        cos = (ref * ours).sum(1)
        st_s, ours_s = statistics.median(st_times), statistics.median(ours_times)
        print(f"texts {len(texts)}, tokens {num_tokens}, torch threads {torch.get_num_threads()}, "
              f"batch {args.batch_size}, rounds {args.rounds}")  # fmt: skip
        for name, secs, cpu_s in (("sentence-transformers encode", st_s, statistics.median(st_cpu)),
                                  ("raytp LLM.embed", ours_s, statistics.median(ours_cpu))):  # fmt: skip
            print(f"{name:30s} {secs:.1f} s  ({len(texts) / secs:.1f} texts/s, {num_tokens / secs:.0f} tok/s); "
                  f"process CPU {cpu_s:.1f} s")  # fmt: skip
        cpu_ratio = statistics.median(st_cpu) / statistics.median(ours_cpu)
        print(f"speed-up {st_s / ours_s:.2f}x (CPU time {cpu_ratio:.2f}x); cosine min {cos.min():.6f}")


if __name__ == "__main__":
    main()
