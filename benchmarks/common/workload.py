"""The benchmarks' request sets: random token-id prompts and output lengths, reproducible from a seed.

vLLM's "random" dataset style: prompt lengths and output lengths uniform in their ranges, prompt
token ids uniform over the vocabulary minus its first and last 100 ids (special tokens live at the
ends). The lengths come from `seed` alone, the token ids from `seed` and the round: every timed round
has the same shape of work (so its seconds compare with the other rounds') but prompts no engine has
seen before, so no prefix cache is warm for them (a repeated set would let raytp's prefix cache skip
the prefills the baseline recomputes). All engines get the same set in a round.
"""

from __future__ import annotations

import random

Request = tuple[list[int], int]  # (prompt token ids, output tokens to generate with ignore_eos)


def random_requests(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int, round_index: int = 0
) -> list[Request]:
    """`n` requests; timed rounds are 0, 1, ...; pass -1 (or below) for warm-up sets no round repeats."""
    lengths = random.Random(seed)
    ids = random.Random(f"{seed}/{round_index}")  # str seeds hash deterministically (sha512), unlike hash()
    out = []
    for _ in range(n):
        n_in = lengths.randint(*input_len)
        n_out = lengths.randint(*output_len)
        out.append(([ids.randrange(100, vocab - 100) for _ in range(n_in)], n_out))
    return out


def describe(work: list[Request]) -> str:
    ins, outs = [len(p) for p, _ in work], [n for _, n in work]
    return (
        f"{len(work)} requests, prompts {min(ins)}-{max(ins)} tokens (total {sum(ins)}), "
        f"outputs {min(outs)}-{max(outs)} (total {sum(outs)})"
    )


def total_tokens(work: list[Request]) -> tuple[int, int]:
    """(prompt tokens, output tokens) of a request set."""
    return sum(len(p) for p, _ in work), sum(n for _, n in work)
