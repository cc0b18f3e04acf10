"""Our model vs Hugging Face transformers: prefill logits at every position, no engine involved.

Three prompts of different lengths (one a single token, others crossing KV block
boundaries) run as ONE batched step through the torch paged-attention backend; the
reference runs each prompt through `transformers` on its own. Also: chunked prefill on
top of cached context, tensor parallelism simulated in threads (TP=2/4) and in real gloo
processes, and building shards without materialising the full model.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model_exec.models import build_model, get_model_class, supported_architectures
from model_exec.models.decoder import CausalDecoder
from model_exec.parallel import TPGroup
from model_exec.source import load_tokenizer, read_model_config, resolve_model
from model_exec.weights import iter_weights
from ops.attention import get_attn_backend
from tests.helpers.tiny_models import (
    hf_default_model,
    hf_prefill_logits,
    load_our_model,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_untied_rope_scaled,
    our_prefill_logits,
    run_in_rank_threads,
    tp_prefill_worker,
)

PROMPTS = [[5, 17, 33, 2, 101, 250, 7], [42], [3 + (7 * i) % 250 for i in range(13)]]
CHUNKED_PROMPTS = [PROMPTS[0], [42, 43, 44, 45, 46], PROMPTS[2]]
MAKERS: dict[str, Callable[..., str]] = {
    "llama-gqa": make_tiny_llama,
    "qwen2-qkv-bias": make_tiny_qwen2,
    "untied-llama3-rope": make_tiny_untied_rope_scaled,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make(root) for name, make in MAKERS.items()}


def _hf_logits(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_prefill_logits(hf, prompts)


def _assert_logits_match(ours: list[torch.Tensor] | None, ref: list[torch.Tensor], atol: float = 1e-4) -> None:
    assert ours is not None
    for row, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.shape == b.shape, row
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m, r=row: f"prompt {r}: {m}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"prompt {row}: greedy tokens differ"


@pytest.mark.parametrize("name", MAKERS)
def test_prefill_matches_hf(name: str, tiny: dict[str, str]) -> None:
    net, config = load_our_model(tiny[name])
    _assert_logits_match(our_prefill_logits(net, config, PROMPTS), _hf_logits(tiny[name], PROMPTS))


@pytest.mark.parametrize("name", MAKERS)
def test_chunked_prefill_on_cached_context_matches_hf(name: str, tiny: dict[str, str]) -> None:
    net, config = load_our_model(tiny[name])
    ours = our_prefill_logits(net, config, CHUNKED_PROMPTS, first_chunk=3)
    _assert_logits_match(ours, _hf_logits(tiny[name], CHUNKED_PROMPTS))


@pytest.mark.parametrize(
    ("name", "ws"),
    [
        ("llama-gqa", 2),
        ("llama-gqa", 4),
        ("qwen2-qkv-bias", 2),
        ("untied-llama3-rope", 2),
        ("untied-llama3-rope", 4),
    ],
)
def test_tensor_parallel_in_threads_matches_hf(name: str, ws: int, tiny: dict[str, str]) -> None:
    def rank(tp: TPGroup) -> list[torch.Tensor] | None:
        net, config = load_our_model(tiny[name], tp)
        assert net.model.layers[0].self_attn.num_kv_heads == config.num_key_value_heads // ws
        return our_prefill_logits(net, config, PROMPTS, tp)

    results = run_in_rank_threads(ws, rank)
    assert all(r is None for r in results[1:])
    _assert_logits_match(results[0], _hf_logits(tiny[name], PROMPTS))


@pytest.mark.parametrize(("name", "ws"), [("llama-gqa", 2), ("untied-llama3-rope", 4)])
def test_tensor_parallel_over_gloo_processes(name: str, ws: int, tiny: dict[str, str], tmp_path: Path) -> None:
    """Real torch.distributed: init_tp_group + gloo all-reduce/gather across `ws` processes."""
    out = tmp_path / "logits.pt"
    init = f"file://{tmp_path / 'rendezvous'}"  # no port to pick or collide on
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=tp_prefill_worker, args=(r, ws, init, tiny[name], PROMPTS, str(out))) for r in range(ws)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * ws
    _assert_logits_match(torch.load(out), _hf_logits(tiny[name], PROMPTS))


def test_shards_are_built_at_rank_shape_on_the_target_device(tiny: dict[str, str]) -> None:
    config = read_model_config(resolve_model(tiny["untied-llama3-rope"]))
    backend = get_attn_backend("torch", "cpu")

    def rank(tp: TPGroup) -> dict[str, tuple[int, ...]]:
        # "meta" allocates nothing: construction itself never materialises weights
        net = build_model(config, tp, backend, "meta", torch.bfloat16)
        assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in net.parameters())
        assert net.model.rotary_embs[0].cos_sin_cache.dtype == torch.float32
        return {n: tuple(p.shape) for n, p in net.named_parameters()}

    shapes = run_in_rank_threads(4, rank)
    layer = "model.layers.0."
    assert shapes[0][layer + "self_attn.qkv_proj.weight"] == ((8 + 2 * 4) * 16 // 4, 64)
    assert shapes[0][layer + "self_attn.o_proj.weight"] == (64, 8 * 16 // 4)
    assert shapes[0][layer + "self_attn.o_proj.bias"] == (64,)
    assert shapes[0][layer + "mlp.gate_up_proj.weight"] == (2 * 96 // 4, 64)
    assert shapes[0][layer + "mlp.down_proj.weight"] == (64, 96 // 4)
    assert shapes[0]["model.embed_tokens.weight"] == shapes[0]["lm_head.weight"] == (76, 64)  # ceil(302 / 4)
    assert shapes[0] == shapes[3]


def test_registry_and_construction_checks(tiny: dict[str, str]) -> None:
    llama_rows = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
    assert llama_rows <= set(supported_architectures())
    assert all(get_model_class(a) is CausalDecoder for a in llama_rows)
    # every row names a class its module has (families beyond Llama's are tested in families/); a name may be
    # an alias (the base-model embedder rows: LlamaModel = CausalDecoderEmbedder)
    assert all(isinstance(get_model_class(a), type) for a in supported_architectures())
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported"):
        get_model_class("GPT2LMHeadModel")
    config = read_model_config(resolve_model(tiny["qwen2-qkv-bias"]))  # 4 q / 2 kv heads
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide"):
        build_model(config, TPGroup(0, 4), get_attn_backend("torch", "cpu"), "meta")


def test_load_weights_is_strict(tiny: dict[str, str]) -> None:
    src = resolve_model(tiny["llama-gqa"])
    config = read_model_config(src)
    net = build_model(config, TPGroup.single(), get_attn_backend("torch", "cpu"), "cpu")
    assert net.lm_head.weight is net.model.embed_tokens.weight  # tied
    weights = list(iter_weights(src))
    extra = [
        ("lm_head.weight", torch.zeros(config.vocab_size, config.hidden_size)),  # tied: skipped
        ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(4)),
    ]  # old checkpoints: skipped
    net.load_weights(weights + extra)
    with pytest.raises(ValueError, match="no weights for 1 parameters"):
        net.load_weights(w for w in weights if w[0] != "model.norm.weight")
    with pytest.raises(ValueError, match="no weights for .*qkv_proj"):  # a fused parameter missing one part
        net.load_weights(w for w in weights if w[0] != "model.layers.1.self_attn.v_proj.weight")
    with pytest.raises(ValueError, match="matches no parameter"):
        net.load_weights([*weights, ("model.layers.0.self_attn.q_norm.weight", torch.ones(8))])


def test_bfloat16_model_tracks_fp32(tiny: dict[str, str]) -> None:
    net32, config = load_our_model(tiny["llama-gqa"])
    net16, _ = load_our_model(tiny["llama-gqa"], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in net16.parameters())
    ref, low = our_prefill_logits(net32, config, PROMPTS), our_prefill_logits(net16, config, PROMPTS)
    assert ref is not None and low is not None
    for a, b in zip(low, ref, strict=True):
        assert torch.isfinite(a).all()
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


@pytest.mark.slow
def test_embedded_smollm2_prefill_matches_hf() -> None:
    src = resolve_model(None)
    tok = load_tokenizer(src)
    texts = [
        "The capital of France is",
        "Hi",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    ]
    prompts = [tok(t)["input_ids"] for t in texts]
    assert len({len(p) for p in prompts}) == 3
    net, config = load_our_model(None)
    ours = our_prefill_logits(net, config, prompts, block_size=16)
    _assert_logits_match(ours, hf_prefill_logits(hf_default_model(), prompts))
    assert tok.decode(ours[0][-1].argmax()) == " Paris"
