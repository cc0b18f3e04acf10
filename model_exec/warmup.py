"""A warm start on CUDA: the decode attention variants an eager step can launch compile at engine start.

Triton compiles a kernel variant the first time it meets a new set of compile-time parameters. Engine
start already launches two kinds: the profile run's prefill (`model_runner.profile_forward`, the one
prefill variant, since the kernel does not specialise on the batch's row count or block-table width) and,
with CUDA graphs, each captured decode bucket. What remains are eager decode steps (enforce_eager, LoRA,
TP > 1, batches past the largest graph): the Triton backend splits a decode row's keys into 1..16
segments by the batch's longest context (`ops.attention.triton_backend.decode_segments`), one variant
each, met one by one as contexts grow. `warm_up_decode` runs one-row decode steps at contexts of 128,
256, ... up to max_model_len; one row takes the most segments a context allows, so every split a later
step can choose is compiled before the first request.

Invariant: it runs before any request is scheduled (`ModelShard.init_cache`), on every rank (the forward
all-reduces under tensor parallelism), and writes one token's key/value into slot 0 of block 0, which
holds nothing yet.
"""

from __future__ import annotations

import logging
import time

import torch

from model_exec.models import CausalLM
from ops.attention.base import AttentionMetadata
from ops.cache_ops import KVCache

logger = logging.getLogger(__name__)

# Shortest context tried: below two 128-key segments a decode row never splits.
_FIRST_CONTEXT = 128


def warm_up_contexts(max_model_len: int) -> list[int]:
    """128, 256, ... below max_model_len, then max_model_len itself."""
    contexts = []
    n = _FIRST_CONTEXT
    while n < max_model_len:
        contexts.append(n)
        n *= 2
    return [*contexts, max_model_len]


@torch.inference_mode()
def warm_up_decode(
    model: CausalLM, kv_caches: list[KVCache], block_size: int, max_model_len: int, device: torch.device
) -> float:
    """One-row eager decode forwards at each of `warm_up_contexts(max_model_len)`; returns the seconds taken."""
    start = time.perf_counter()
    for context in warm_up_contexts(max_model_len):
        width = -(-context // block_size)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([context], dtype=torch.int32, device=device),
            block_tables=torch.zeros((1, width), dtype=torch.int32, device=device),  # block 0 for every key
            slot_mapping=torch.zeros(1, dtype=torch.long, device=device),
            max_query_len=1,
            max_seq_len=context,
            num_decodes=1,
        )
        positions = torch.tensor([context - 1], dtype=torch.long, device=device)
        model(torch.zeros(1, dtype=torch.long, device=device), positions, kv_caches, meta)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    logger.info("warm start: decode kernels launched at contexts up to %d in %.1f s", max_model_len, seconds)
    return seconds
