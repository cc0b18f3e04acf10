"""A Q4_K_M-style GGUF kept in its super-blocks (issue 39): a tiny Llama 256 wide (K-quants need rows of
whole 256-weight super-blocks) with llama.cpp's Q4_K_M mix, Q6_K for token_embd, attn_v and ffn_down, Q4_K
for the rest, written by the tests' numpy K-quant writer (the `gguf` package cannot quantize these types).

- every linear layer keeps its blocks, the fused qkv as two segments (q and k Q4_K, v Q6_K), the tied
  embedding / LM head Q6_K; prefill logits follow the dequantized fp32 reference;
- tensor parallelism at TP 2: row-parallel o_proj (K = 256) is cut inside a super-block and runs as floats,
  down_proj (K = 512) is cut on one and keeps its blocks;
- through the engine (`quantization="gguf"` vs `"none"`): greedy tokens follow the dequantized-float run's
  (vLLM's check_logprobs_close: equal until a near-tie, where each is in the other's top 5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from model_exec.layers.linear import LinearBase  # noqa: E402
from model_exec.layers.quantization.gguf import GGUFLinearMethod, kernels_available  # noqa: E402
from model_exec.parallel import TPGroup  # noqa: E402
from tests.helpers.family_parity import ENGINE_PROMPTS, PREFILL_PROMPTS  # noqa: E402
from tests.helpers.tiny_gguf import write_tiny_gguf  # noqa: E402
from tests.helpers.tiny_models import make_tiny_llama, our_prefill_logits, run_in_rank_threads  # noqa: E402
from tests.model_exec.test_gguf_quantized import _load  # noqa: E402  # the model built and loaded kept or not

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C++ kernels' AVX2 build is not available")

T = gguf.GGMLQuantizationType
Q4_K_M = {"token_embd": T.Q6_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "": T.Q4_K}  # first match wins


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = Path(tmp_path_factory.mktemp("kquant"))
    # init 0.1 rather than the 64-wide default's 0.3: at 4x the width that random model's layers amplify every
    # rounding into the next layer's input (kept-vs-dequantized logits' cosine drops to ~0.95 at 0.3)
    hf = make_tiny_llama(tmp, hidden_size=256, intermediate_size=512, initializer_range=0.1)
    return write_tiny_gguf(hf, tmp / "gguf", quant_types=Q4_K_M)


def _close(ours: list[torch.Tensor] | None, ref: list[torch.Tensor] | None, cosine: float) -> None:
    assert ours is not None and ref is not None
    for a, b in zip(ours, ref, strict=True):
        # the tiny model's random weights amplify each layer's int8 rounding; a wrong block layout, row order
        # or scale gives uncorrelated logits (cosine ~0)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert float(cos.min()) > cosine, cos


def test_blocks_are_kept_and_follow_the_dequantized_reference(path: str) -> None:
    kept, config = _load(path, keep=True)
    layer0 = kept.model.layers[0]  # type: ignore[union-attr]
    methods = [m.quant_method for m in kept.modules() if isinstance(m, LinearBase)]
    assert methods and all(isinstance(m, GGUFLinearMethod) and m.segments and m.dense is None for m in methods)
    assert [q for q, _ in layer0.self_attn.qkv_proj.quant_method.segments] == [int(T.Q4_K), int(T.Q6_K)]
    assert [q for q, _ in layer0.mlp.down_proj.quant_method.segments] == [int(T.Q6_K)]
    assert [q for q, _ in layer0.mlp.gate_up_proj.quant_method.segments] == [int(T.Q4_K)]
    embed = kept.model.embed_tokens  # type: ignore[union-attr]
    assert embed.gguf_weight is not None and embed.gguf_weight[0] == int(T.Q6_K)
    assert kept.lm_head.gguf_weight is embed.gguf_weight  # type: ignore[union-attr]
    reference, _ = _load(path, keep=False)
    _close(
        our_prefill_logits(kept, config, PREFILL_PROMPTS), our_prefill_logits(reference, config, PREFILL_PROMPTS), 0.98
    )


def test_tensor_parallel_cuts_inside_a_super_block_run_as_floats(path: str) -> None:
    reference, config = _load(path, keep=False)
    expected = our_prefill_logits(reference, config, PREFILL_PROMPTS)

    def rank(tp: TPGroup) -> list[torch.Tensor] | None:
        net, cfg = _load(path, keep=True, tp=tp)
        layer = net.model.layers[0]  # type: ignore[union-attr]
        o_proj, down = layer.self_attn.o_proj.quant_method, layer.mlp.down_proj.quant_method
        assert o_proj.dense is not None and not o_proj.segments  # 128 of 256 features: inside a super-block
        assert [q for q, _ in down.segments] == [int(T.Q6_K)]  # 256 of 512: whole super-blocks
        assert layer.self_attn.qkv_proj.quant_method.segments  # column-parallel: whole rows
        return our_prefill_logits(net, cfg, PREFILL_PROMPTS, tp=tp)

    _close(run_in_rank_threads(2, rank)[0], expected, 0.98)


def test_engine_greedy_tokens_follow_the_dequantized_run(path: str) -> None:
    """Through the engine, greedy with top-5 logprobs, kept blocks vs the same file dequantized: vLLM's
    check_logprobs_close (benchmarks/fp8_check.compare). Token-for-token equality is not the contract: the
    kernels round the activations to int8 per 32 (as llama.cpp does), and the tiny random model's near-ties
    flip on that; each sequence must agree until a divergence at which each side's token is in the other's
    top 5, and the agreed tokens' logprobs stay close."""
    from benchmarks.fp8_check import _greedy, compare
    from raytp import LLM

    prompts = [p for p in (*PREFILL_PROMPTS, *ENGINE_PROMPTS) if len(p) > 1]
    runs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(
            path, quantization=quantization, distributed_executor_backend="inprocess", kv_cache_memory_bytes=1 << 24
        )
        try:
            assert llm.llm_engine.executor.worker.shard.quantization == quantization
            runs[quantization] = _greedy(llm, prompts, 12, 5)
        finally:
            llm.llm_engine.shutdown()
    report = compare(runs["gguf"], runs["none"])
    print("Q4_K_M kept vs dequantized:", report)
    assert not report["mismatch"], report
    assert report["first_token_agreement"] >= 0.8, report
    assert report["max_logprob_diff_where_agreeing"] < 0.5, report
