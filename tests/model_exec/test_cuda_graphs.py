"""The CUDA-graph decode buckets and their padding (model_exec/cuda_graphs.py), checked on the CPU.

Capture and replay need CUDA (benchmarks/gpu_check.py runs them); what a replay computes is the model
on the padded batch, which the CPU runs eagerly here: the real rows must come out as without padding,
and the pad rows may touch only the pad block.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from model_exec.cuda_graphs import DecodeGraphs, DecodeInputs, bucket_for, capture_sizes, pad_decode_inputs
from ops.attention.base import AttentionMetadata
from tests.helpers.tiny_models import load_our_model, make_kv_caches, make_tiny_llama, prefill_inputs


def test_buckets_are_powers_of_two_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert capture_sizes(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert capture_sizes(4096)[-1] == 512  # larger batches run eagerly
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)
    sizes = capture_sizes(100)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 64, 65, 100, 101)] == [1, 2, 4, 8, 64, 100, 100, None]


def _decode_inputs(n: int, width: int) -> DecodeInputs:
    return DecodeInputs(
        input_ids=torch.arange(5, 5 + n),
        positions=torch.arange(n) + 7,
        slot_mapping=torch.arange(n) * 3,
        seq_lens=torch.arange(n, dtype=torch.int32) + 8,
        block_tables=torch.arange(n * width, dtype=torch.int32).reshape(n, width) + 1,
    )


def test_padding_appends_one_token_rows_on_the_pad_block() -> None:
    inputs = _decode_inputs(3, width=2)
    padded = pad_decode_inputs(inputs, bucket=8, pad_block=40, block_size=16)
    assert padded.num_rows == 8
    assert torch.equal(padded.input_ids[:3], inputs.input_ids) and padded.input_ids[3:].eq(0).all()
    assert torch.equal(padded.positions[:3], inputs.positions) and padded.positions[3:].eq(0).all()
    assert padded.slot_mapping[3:].eq(40 * 16).all() and padded.seq_lens[3:].eq(1).all()
    assert padded.block_tables[3:, 0].eq(40).all() and torch.equal(padded.block_tables[:3], inputs.block_tables)
    assert pad_decode_inputs(inputs, bucket=3, pad_block=40, block_size=16) is inputs
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_inputs(inputs, bucket=2, pad_block=40, block_size=16)


def _meta(inputs: DecodeInputs, max_seq_len: int) -> AttentionMetadata:
    n = inputs.num_rows
    return AttentionMetadata(
        # on the inputs' device: the Triton kernels take it as a pointer (a CPU tensor here was the GPU failure
        # "Pointer argument (at 9) cannot be accessed from Triton": argument 9 of the paged-attention kernel)
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=inputs.seq_lens.device),
        seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables,
        slot_mapping=inputs.slot_mapping,
        max_query_len=1,
        max_seq_len=max_seq_len,
        num_decodes=n,
    )


PROMPTS = [[1, 9, 8, 7, 6, 5], [1, 20, 21], [1, 30, 31, 32, 33, 34, 35, 36, 37]]


def _prefilled(
    net: torch.nn.Module, config: Any, block_size: int, dtype: torch.dtype, device: str
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], DecodeInputs, int]:
    """(caches after prefilling PROMPTS, with one spare block at the end; the host inputs of one decode token
    per row, at position len(prompt) in the row's own blocks as prefill_inputs laid them; the spare block)."""
    ids, positions, meta, num_blocks = prefill_inputs(PROMPTS, block_size, device)
    caches = make_kv_caches(config, 1, num_blocks + 1, block_size, dtype, device)
    net(ids, positions, caches, meta)
    lens = [len(p) for p in PROMPTS]
    row_first = [1, 1 + -(-lens[0] // block_size), 1 + -(-lens[0] // block_size) + -(-lens[1] // block_size)]
    width = max(-(-(n + 1) // block_size) for n in lens)
    tables = torch.zeros((3, width), dtype=torch.int32)
    for i, n in enumerate(lens):
        blocks = -(-(n + 1) // block_size)
        tables[i, :blocks] = torch.arange(row_first[i], row_first[i] + blocks, dtype=torch.int32)
    decode = DecodeInputs(
        input_ids=torch.tensor([11, 12, 13]),
        positions=torch.tensor(lens),
        slot_mapping=torch.tensor(
            [int(tables[i, n // block_size]) * block_size + n % block_size for i, n in enumerate(lens)]
        ),
        seq_lens=torch.tensor([n + 1 for n in lens], dtype=torch.int32),
        block_tables=tables,
    )
    return caches, decode, num_blocks


def _on(inputs: DecodeInputs, device: str) -> DecodeInputs:
    return DecodeInputs(*(t.to(device) for t in dataclasses.astuple(inputs)))


@torch.inference_mode()
def test_padded_decode_computes_the_real_rows_and_writes_only_the_pad_block(tmp_path: Path) -> None:
    block_size = 4
    net, config = load_our_model(make_tiny_llama(tmp_path / "tiny"))
    caches, decode, pad_block = _prefilled(net, config, block_size, torch.float32, "cpu")

    plain_caches = [(k.clone(), v.clone()) for k, v in caches]
    plain = net(decode.input_ids, decode.positions, plain_caches, _meta(decode, max(decode.seq_lens.tolist())))

    padded = pad_decode_inputs(decode, bucket=8, pad_block=pad_block, block_size=block_size)
    padded_caches = [(k.clone(), v.clone()) for k, v in caches]
    # A capture passes max_model_len as max_seq_len: an upper bound must give the same result.
    out = net(padded.input_ids, padded.positions, padded_caches, _meta(padded, config.max_position_embeddings))

    assert out.shape[0] == 8
    torch.testing.assert_close(out[:3], plain, rtol=1e-5, atol=1e-5)
    # Slots the step changed: the real rows' own (the same values up to GEMM rounding) and the pad slot only.
    flat = lambda c: c.reshape(-1, c.shape[2] * c.shape[3])  # noqa: E731  [slots, heads * head_dim]
    expected = {*decode.slot_mapping.tolist(), pad_block * block_size}
    for (k0, v0), (pk, pv), (qk, qv) in zip(caches, plain_caches, padded_caches, strict=True):
        for before, mine, theirs in ((k0, qk, pk), (v0, qv, pv)):
            changed = (flat(mine) != flat(before)).any(dim=1).nonzero().flatten().tolist()
            assert set(changed) == expected
            torch.testing.assert_close(mine[:pad_block], theirs[:pad_block], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_cuda_graph_replay_matches_eager_decode(tmp_path: Path) -> None:
    """On a GPU with a capturable backend (what `auto` picks): the replayed graph's rows are the eager step's."""
    from model_exec.models import build_model, pack_weights
    from model_exec.parallel import TPGroup
    from model_exec.source import read_model_config, resolve_model
    from model_exec.weights import iter_weights
    from ops.attention import get_attn_backend

    block_size, dtype = 16, torch.float16
    backend = get_attn_backend("auto", "cuda", dtype, block_size)
    if not backend.cuda_graph_capturable:
        pytest.skip(f"attention_backend {backend.name!r} (auto's choice here) is not CUDA-graph capturable")
    src = resolve_model(make_tiny_llama(tmp_path / "tiny"))
    config = read_model_config(src)
    net = build_model(config, TPGroup.single(), backend, torch.device("cuda"), dtype)
    net.load_weights(iter_weights(src))
    pack_weights(net)
    caches, decode, pad_block = _prefilled(net, config, block_size, dtype, "cuda")

    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    dev = _on(decode, "cuda")
    eager = net(dev.input_ids, dev.positions, eager_caches, _meta(dev, max(decode.seq_lens.tolist())))
    graphs = DecodeGraphs(
        net,
        caches,
        sizes=(1, 2, 4, 8),
        max_model_len=config.max_position_embeddings,
        block_size=block_size,
        pad_block=pad_block,
        device=torch.device("cuda"),
    )
    graphs.capture()
    replayed = graphs.run(decode)
    assert replayed is not None and replayed.shape[0] == 4
    torch.testing.assert_close(replayed[:3], eager, rtol=2e-3, atol=2e-3)
    for (ek, ev), (gk, gv) in zip(eager_caches, caches, strict=True):
        torch.testing.assert_close(gk[:pad_block], ek[:pad_block], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(gv[:pad_block], ev[:pad_block], rtol=2e-3, atol=2e-3)
