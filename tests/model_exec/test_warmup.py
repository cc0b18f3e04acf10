"""The warm start's decode forwards (model_exec/warmup.py), run on the CPU: the contexts it visits cover every
decode split the Triton backend can choose, and it writes nothing but block 0's first slot."""

from __future__ import annotations

from pathlib import Path

import torch

from model_exec.warmup import warm_up_contexts, warm_up_decode
from ops.attention.triton_backend import decode_segments
from tests.helpers.tiny_models import load_our_model, make_kv_caches, make_tiny_llama


def test_contexts_double_from_128_and_end_at_max_model_len() -> None:
    assert warm_up_contexts(100) == [100]
    assert warm_up_contexts(128) == [128]
    assert warm_up_contexts(1000) == [128, 256, 512, 1000]
    assert warm_up_contexts(4096) == [128, 256, 512, 1024, 2048, 4096]


def test_one_row_at_the_warm_contexts_reaches_every_split_a_batch_can_choose() -> None:
    # Any batch's split (rows, KV heads, its longest context <= max_model_len, SMs) is one the warm-up chose.
    for max_model_len in (512, 4096, 32768):
        for kv_heads, sms in ((8, 132), (2, 132), (32, 78), (1, 16)):
            warm = {decode_segments(1, kv_heads, c, sms) for c in warm_up_contexts(max_model_len)}
            for rows in (1, 2, 3, 7, 16, 64, 256):
                for keys in range(1, max_model_len + 1, 97):
                    assert decode_segments(rows, kv_heads, keys, sms) in warm, (max_model_len, kv_heads, rows, keys)


@torch.inference_mode()
def test_warm_up_writes_only_block_zero_slot_zero(tmp_path: Path) -> None:
    net, config = load_our_model(make_tiny_llama(tmp_path / "tiny"))
    block_size, num_blocks = 16, 6
    caches = make_kv_caches(config, 1, num_blocks, block_size, torch.float32, "cpu")
    for k, v in caches:  # stand-ins for what the pool would hold
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in caches]
    seconds = warm_up_decode(net, caches, block_size, max_model_len=300, device=torch.device("cpu"))
    assert seconds >= 0
    for (k0, v0), (k, v) in zip(before, caches, strict=True):
        for old, new in ((k0, k), (v0, v)):
            assert torch.equal(old[1:], new[1:]) and torch.equal(old[0, 1:], new[0, 1:])
            assert not torch.equal(old[0, 0], new[0, 0])  # the one token's key/value landed there
