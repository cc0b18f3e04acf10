"""Rope scaling types against Hugging Face's `modeling_rope_utils`: yarn, longrope and dynamic, each
angle for angle (partial rotary too) and through a tiny Llama's prefill with positions past the
original context; linear and llama3 are covered by tests/model_exec/test_layers.py and the untied
rope-scaled Llama of test_model_parity.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model_exec.config import ModelConfig
from model_exec.layers.rotary import RotaryEmbedding
from model_exec.parallel import TPGroup
from tests.helpers.family_parity import PREFILL_PROMPTS, assert_logits_match, assert_prefill_matches_hf, hf_model
from tests.helpers.tiny_models import (
    hf_prefill_logits,
    load_our_model,
    make_tiny_llama,
    our_prefill_logits,
    run_in_rank_threads,
)

HEAD_DIM = 16
_gen = torch.Generator().manual_seed(7)
SHORT = (1.0 + torch.rand(HEAD_DIM // 2, generator=_gen)).tolist()
LONG = (2.0 + 6.0 * torch.rand(HEAD_DIM // 2, generator=_gen)).tolist()
# per type: rope parameters, max_position_embeddings, and a sequence length on each side of the threshold
ANGLE_CASES: dict[str, tuple[dict[str, Any], int, tuple[int, ...]]] = {
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256, (256,)),
    "yarn-mscale": (
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "truncate": False,
        },
        256,
        (256,),
    ),
    "longrope": (
        {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 32},
        128,
        (32, 33, 100),
    ),
    "longrope-factor": (
        {
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "factor": 3.0,
            "original_max_position_embeddings": 32,
        },
        128,
        (20, 90),
    ),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 64, (64, 65, 150)),
}


@pytest.mark.parametrize("case", ANGLE_CASES)
def test_angles_match_hf(case: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params, max_pos, lengths = ANGLE_CASES[case]
    cfg = LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=max_pos, rope_scaling=dict(params)
    )
    config = ModelConfig.from_hf_config(cfg)
    ours = RotaryEmbedding(config.head_dim, max_pos, config.rope_theta, config.rope_scaling, config.rotary_dim)
    x = torch.zeros(1, 1, HEAD_DIM)
    for length in lengths:
        hf = LlamaRotaryEmbedding(cfg)  # fresh: HF's dynamic rope keeps state between calls
        cos, sin = hf(x, torch.arange(length)[None])
        positions = torch.arange(length)
        seq_lens = torch.full_like(positions, length) if ours.length_dependent else None
        ours_cos, ours_sin = ours.cos_sin(positions, seq_lens)
        torch.testing.assert_close(torch.cat([ours_cos, ours_cos], -1), cos[0], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([ours_sin, ours_sin], -1), sin[0], rtol=0, atol=0)
    if ours.length_dependent:  # the case does exercise both regimes, and a mixed batch picks per token
        short, long = min(lengths), max(lengths)
        positions = torch.tensor([0, 5, 0, 5])
        mixed = ours.cos_sin(positions, torch.tensor([short, short, long, long]))[0]
        assert torch.equal(mixed[:2], ours.cos_sin(positions[:2], torch.tensor([short, short]))[0])
        assert torch.equal(mixed[2:], ours.cos_sin(positions[2:], torch.tensor([long, long]))[0])
        assert not torch.equal(mixed[1], mixed[3])


def test_partial_rotary_longrope_matches_hf_phi3() -> None:
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    rotary_dim = 12  # 0.75 of 16: 6 frequencies
    cfg = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        original_max_position_embeddings=32,
        partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "short_factor": SHORT[:6], "long_factor": LONG[:6]},
    )
    config = ModelConfig.from_hf_config(cfg)
    assert config.rotary_dim == rotary_dim
    ours = RotaryEmbedding(config.head_dim, 128, config.rope_theta, config.rope_scaling, config.rotary_dim)
    gen = torch.Generator().manual_seed(0)
    for length in (20, 60):
        positions = torch.arange(length)
        q = torch.randn(length, 4, HEAD_DIM, generator=gen)
        k = torch.randn(length, 2, HEAD_DIM, generator=gen)
        cos, sin = Phi3RotaryEmbedding(cfg)(q, positions[None])
        ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        meta = _one_row_meta(length)
        out_q, out_k = ours(positions, q, k, meta)
        torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), rtol=0, atol=0)
        assert torch.equal(out_q[..., rotary_dim:], q[..., rotary_dim:])  # the tail passes through
        # the in-place path (the fused kernel on a strided q|k view) gives the same bits
        qk = torch.cat([q, k], dim=1)
        rotated = RotaryEmbedding.rotate_owned(ours.angles(positions, torch.float32, meta), qk.clone())
        torch.testing.assert_close(rotated, torch.cat([out_q, out_k], dim=1), rtol=0, atol=0)


def _one_row_meta(length: int) -> Any:
    from ops.attention.base import AttentionMetadata

    return AttentionMetadata(
        query_start_loc=torch.tensor([0, length], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.arange(length),
        max_query_len=length,
        max_seq_len=length,
    )


def test_length_dependent_rope_needs_the_sequence_lengths() -> None:
    ours = RotaryEmbedding(HEAD_DIM, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="needs the step's attention metadata"):
        ours.angles(torch.arange(3), torch.float32)
    with pytest.raises(ValueError, match="does not depend on the sequence length"):
        RotaryEmbedding(HEAD_DIM, 64, 10000.0).cos_sin(torch.arange(3), torch.full((3,), 3))


# Prefill parity on a tiny Llama (8 q / 4 KV heads, head_dim 16, hidden 64): prompts of 7, 1, 13 and 45 tokens.
def test_yarn_prefill_matches_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    path = make_tiny_llama(tmp_path_factory.mktemp("yarn"), head_dim=HEAD_DIM, rope_scaling=scaling)
    assert_prefill_matches_hf(path, (1, 2))


def test_longrope_prefill_matches_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    """original 10 between the prompts' lengths: short factors for 7 and 1, long for 13 and 45; the chunked
    prefill's first chunk (11 tokens) is past it already, as HF's whole-prompt forward is."""
    scaling = {
        "rope_type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": 10,
    }
    path = make_tiny_llama(
        tmp_path_factory.mktemp("longrope"), head_dim=HEAD_DIM, max_position_embeddings=64, rope_scaling=scaling
    )
    assert_prefill_matches_hf(path, (1, 2), first_chunk=11)


def test_dynamic_prefill_matches_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    """max_position_embeddings 16: the 45-token prompt runs with its own rescaled base (positions past the
    cache), the others unscaled. One prefill step per prompt set: HF rescales by the whole prompt's length,
    which a chunk of it cannot know (model_exec/layers/rotary.py)."""
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    path = make_tiny_llama(
        tmp_path_factory.mktemp("dynamic"), head_dim=HEAD_DIM, max_position_embeddings=16, rope_scaling=scaling
    )
    ref = hf_prefill_logits(hf_model(path), PREFILL_PROMPTS)
    for ws in (1, 2):

        def rank(tp: TPGroup) -> list[torch.Tensor] | None:
            net, config = load_our_model(path, tp)
            return our_prefill_logits(net, config, PREFILL_PROMPTS, tp)

        results = run_in_rank_threads(ws, rank)
        assert_logits_match(results[0], ref)
    # the rescaled base matters: unscaled rope on the long prompt gives other logits
    plain = make_tiny_llama(tmp_path_factory.mktemp("plain"), head_dim=HEAD_DIM, max_position_embeddings=64)
    net, config = load_our_model(plain)
    assert not torch.allclose(our_prefill_logits(net, config, PREFILL_PROMPTS[3:])[0], ref[3], atol=1e-2)


def test_dynamic_rope_lifts_the_context_limit_by_its_factor() -> None:
    from cluster.config import EngineConfig
    from cluster.engine import resolve_config
    from tests.helpers.tiny_models import tiny_llama_config

    dynamic = ModelConfig.from_hf_config(
        tiny_llama_config(max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 2.5})
    )
    assert resolve_config(EngineConfig(device="cpu"), dynamic).max_model_len == 160
    yarn = ModelConfig.from_hf_config(
        tiny_llama_config(
            max_position_embeddings=64,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        )
    )
    assert resolve_config(EngineConfig(device="cpu"), yarn).max_model_len == 64
    with pytest.raises(ValueError, match=r"larger than the model's context limit \(160"):
        resolve_config(EngineConfig(device="cpu", max_model_len=161), dynamic)


@pytest.mark.parametrize(("kind", "first", "total"), [("longrope", 10, 16), ("dynamic", 12, 20)])
def test_a_step_that_crosses_the_threshold_matches_hf_with_its_cache(
    kind: str, first: int, total: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two steps, as a generation crossing the threshold makes them: the first at or below it (short
    factors, unscaled base), the second past it. HF's next forward over its KV cache keeps the keys it
    cached and rotates the new tokens for the new length; raytp's per-step rule does the same."""
    if kind == "longrope":
        scaling = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}
        scaling["original_max_position_embeddings"] = 10
        max_pos = 64
    else:
        scaling, max_pos = {"rope_type": "dynamic", "factor": 2.0}, 16
    path = make_tiny_llama(
        tmp_path_factory.mktemp(f"{kind}-cross"),
        head_dim=HEAD_DIM,
        max_position_embeddings=max_pos,
        rope_scaling=scaling,
    )
    prompt = PREFILL_PROMPTS[3][:total]
    model = hf_model(path)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        head = model(ids[:, :first], use_cache=True)
        tail = model(ids[:, first:], past_key_values=head.past_key_values)
    ref = torch.cat([head.logits[0], tail.logits[0]]).float()
    net, config = load_our_model(path)
    assert_logits_match(our_prefill_logits(net, config, [prompt], first_chunk=first), [ref])
    # and it is not what one forward over the whole sequence gives (the cached keys differ)
    assert not torch.allclose(hf_prefill_logits(model, [prompt])[0][first:], ref[first:], atol=1e-3)
