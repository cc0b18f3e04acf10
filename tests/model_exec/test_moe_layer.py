"""The fused-experts layer against a naive per-token loop, dense and panel-packed, at TP 1 and 2 (threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_exec.layers.moe import FusedMoE, select_experts
from model_exec.parallel import TPGroup
from tests.helpers.tiny_models import run_in_rank_threads

E, TOP_K, H, INTER = 6, 2, 32, 48  # INTER / 2 = 24: not a multiple of 16, so TP 2 takes the unfused panel path


def naive_moe(
    x: torch.Tensor, logits: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, renormalize: bool
) -> torch.Tensor:
    """Token by token, expert by expert, straight from the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        top = torch.topk(probs, TOP_K)
        weights = top.values / top.values.sum() if renormalize else top.values
        for w, e in zip(weights.tolist(), top.indices.tolist(), strict=True):
            h = F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            out[t] += w * (w2[e] @ h)
    return out


def load(moe: FusedMoE, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
    for e in range(E):
        moe.weight_loader(moe.gate_up_proj, w1[e], (e, "gate"))
        moe.weight_loader(moe.gate_up_proj, w3[e], (e, "up"))
        moe.weight_loader(moe.down_proj, w2[e], (e, "down"))


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_fused_moe_matches_per_token_loop(renormalize: bool, packed: bool, world_size: int, num_tokens: int) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    w1, w3 = torch.randn(E, INTER, H, generator=g) / H**0.5, torch.randn(E, INTER, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    x = torch.randn(num_tokens, H, generator=g)
    logits = torch.randn(num_tokens, E, generator=g) * 2

    def rank(tp: TPGroup) -> torch.Tensor:
        moe = FusedMoE(E, TOP_K, H, INTER, renormalize, tp, torch.float32)
        load(moe, w1, w3, w2)
        moe.pack_weights(panels=packed)
        assert (moe.gate_up_panels is not None) == (packed and moe.pack_weights())
        return moe(x, logits)

    ref = naive_moe(x.double(), logits, w1.double(), w3.double(), w2.double(), renormalize).float()
    for out in run_in_rank_threads(world_size, rank):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_select_experts_normalisation() -> None:
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(weights, probs[:, [0, 2]])
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, [0, 2]] / probs[:, [0, 2]].sum())


def test_loader_refuses_bad_shards() -> None:
    moe = FusedMoE(E, TOP_K, H, INTER, True, TPGroup.single(), torch.float32)
    with pytest.raises(ValueError, match="expert index"):
        moe.weight_loader(moe.gate_up_proj, torch.zeros(INTER, H), (E, "gate"))
    with pytest.raises(ValueError, match="shard_id"):
        moe.weight_loader(moe.gate_up_proj, torch.zeros(INTER, H), "gate")
    with pytest.raises(ValueError, match="down_proj"):
        moe.weight_loader(moe.gate_up_proj, torch.zeros(H, INTER), (0, "down"))
    with pytest.raises(ValueError, match="shape"):
        moe.weight_loader(moe.gate_up_proj, torch.zeros(INTER, H + 1), (0, "up"))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(E, E + 1, H, INTER, True, TPGroup.single())
    with pytest.raises(ValueError, match="intermediate size 48 is not divisible by tensor_parallel_size=5"):
        FusedMoE(E, TOP_K, H, INTER, True, TPGroup(0, 5))


def test_packed_rows_do_not_depend_on_their_batch() -> None:
    """With panels, a token's output is bitwise the same alone or among others (batch jobs' byte-identical
    re-runs rely on it for the dense layers; the experts keep it)."""
    g = torch.Generator().manual_seed(1)
    moe = FusedMoE(E, TOP_K, H, 64, True, TPGroup.single(), torch.float32)
    load(moe, *(torch.randn(E, 64, H, generator=g) for _ in range(2)), torch.randn(E, H, 64, generator=g))
    if not moe.pack_weights():
        pytest.skip("the panel kernel is not available here")
    x, logits = torch.randn(24, H, generator=g), torch.randn(24, E, generator=g)
    batched = moe(x, logits)
    for t in (0, 7, 23):
        assert torch.equal(moe(x[t : t + 1], logits[t : t + 1])[0], batched[t])
