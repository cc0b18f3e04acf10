"""The Ray executor: TP ranks as actors give the same greedy tokens as TP=1 and HF; bad configs fail cleanly.

Every parity config here forces chunked prefill (a small token budget) and preemption (a small KV
pool), so the deltas the ranks receive cover new, cached, finished and re-sent sequences.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from cluster.placement import PlacementError, remove_groups_named
from cluster.ray_executor import RayExecutor
from raytp import LLM
from raytp.cli.main import main as cli_main
from tests.cluster.ray_helpers import (
    assert_all_blocks_free,
    assert_nothing_left,
    generate_ids,
    live_placement_groups,
    ray_session,  # noqa: F401  (module fixture)
    tiny_prompts,
)
from tests.cluster.reference import PROMPTS, hf_greedy
from tests.cluster.test_structured_output import samples as structured_samples
from tests.helpers.tiny_models import make_tiny_llama, make_tiny_qwen2

pytestmark = pytest.mark.usefixtures("ray_session")

MAX_NEW = 48
# chunked prefill (16-token budget under 60-token prompts) and preemption (40 blocks of 4 tokens for
# 8 sequences of up to 108 tokens)
SMALL = dict(block_size=4, num_gpu_blocks_override=40, max_num_batched_tokens=16, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("models"))
    return {
        "llama": make_tiny_llama(root / "llama"),
        "qwen2": make_tiny_qwen2(root / "qwen2"),
        "llama_mha8": make_tiny_llama(root / "llama_mha8", num_key_value_heads=8),  # TP=8 divides its heads
    }


@pytest.mark.parametrize(("kind", "preemption_mode"), [("llama", "recompute"), ("qwen2", "swap")])
def test_tp2_matches_tp1_and_hf(models: dict[str, str], kind: str, preemption_mode: str) -> None:
    model, prompts = models[kind], tiny_prompts()
    config = dict(SMALL, preemption_mode=preemption_mode)
    expected = hf_greedy(model, prompts, MAX_NEW)
    tp1 = LLM(model, **config)
    assert generate_ids(tp1, prompts, MAX_NEW) == expected

    tp2 = LLM(model, tensor_parallel_size=2, **config)
    try:
        assert isinstance(tp2.llm_engine.executor, RayExecutor)
        assert generate_ids(tp2, prompts, MAX_NEW) == expected
        assert_all_blocks_free(tp2)
        sched = tp2.llm_engine.scheduler
        preemptions = sched.num_preemptions_swap if preemption_mode == "swap" else sched.num_preemptions_recompute
        assert preemptions > 0, "the KV pool was meant to force preemption"
        # both ranks were asked for their capacity; the override wins on each
        assert tp2.llm_engine.block_manager.num_device_blocks == 40
    finally:
        tp2.llm_engine.shutdown()


@pytest.mark.slow
def test_tp3_smollm2_matches_tp1() -> None:
    """The embedded SmolLM2 (9 query / 3 KV heads) split over 3 ranks, with chunking and preemption: its greedy
    tokens, and its seeded structured-output samples at temperature 1.0 (grammar masks on the TP=3 logits),
    equal TP=1's. TP=1 equals HF token for token on these prompts and more
    (test_engine_parity.py::test_smollm2_matches_hf: every PROMPT, 64 tokens, same fp32 load), so TP=3 equals
    HF as well, without a second HF load of the GGUF here. The kept-quantized GGUF at TP=3 against TP=1:
    tests/serving/test_tensor_parallel.py."""
    # quantization="none" (it travels to the Ray ranks in the config): token-exact parity with HF's fp32
    # dequantised load of the same GGUF; the kept-quantized path has its own tests (test_gguf_quantized.py)
    llm = LLM(
        None,
        tensor_parallel_size=3,
        block_size=4,
        num_gpu_blocks_override=24,
        max_num_batched_tokens=8,
        quantization="none",
    )
    records = [f"Record {i}:" for i in range(6)]  # 6 JSON samples of ~26 tokens: more than 24 blocks of 4 hold
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in PROMPTS[:4]]
        got = generate_ids(llm, prompts, 32)
        assert_all_blocks_free(llm)
        assert llm.llm_engine.scheduler.num_preemptions_recompute + llm.llm_engine.scheduler.num_preemptions_swap > 0
        samples = structured_samples(llm, records, range(6), max_tokens=60)  # each fits the pool on its own
        assert_all_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()
    tp1 = LLM(None, kv_cache_memory_bytes=1 << 26, quantization="none")
    try:
        assert generate_ids(tp1, prompts, 32) == got
        assert structured_samples(tp1, records, range(6), max_tokens=60) == samples
    finally:
        tp1.llm_engine.shutdown()


def test_tp_not_dividing_heads_fails_before_ray_resources(models: dict[str, str]) -> None:
    before = live_placement_groups()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads=8"):
        LLM(models["llama"], tensor_parallel_size=3)
    assert_nothing_left(before)


def test_tp_larger_than_cluster_fails_fast(models: dict[str, str]) -> None:
    before = live_placement_groups()
    expected = r"tensor_parallel_size=8 needs 8 bundles of \{'CPU': 1\} \(PACK\), but the cluster \(4 CPUs on 1 node\)"
    with pytest.raises(PlacementError, match=expected):
        LLM(models["llama_mha8"], tensor_parallel_size=8)
    assert_nothing_left(before)


def test_cpus_held_elsewhere_time_out_and_leave_nothing(
    models: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster could hold TP=2, but something else holds 3 of its 4 CPUs: wait briefly, then explain."""
    hog = ray.util.placement_group([{"CPU": 3}])
    ray.get(hog.ready(), timeout=30)
    try:
        before = live_placement_groups()
        monkeypatch.setenv("RAYTP_PLACEMENT_TIMEOUT_S", "2")
        with pytest.raises(PlacementError, match=r"within 2 s: the cluster has 1 of 4 CPU free"):
            LLM(models["llama"], tensor_parallel_size=2)
        assert_nothing_left(before)
    finally:
        ray.util.remove_placement_group(hog)


def test_cli_generate_with_tensor_parallel_size(models: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    before = live_placement_groups()
    rc = cli_main(
        ["generate", "--model", models["qwen2"], "--prompt", "hello", "--max-tokens", "8",
         "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(1 << 24), "--json"]
    )  # fmt: skip
    assert rc == 0
    assert '"finish_reason": "length"' in capsys.readouterr().out
    assert_nothing_left(before)  # the CLI shuts the engine down: actors and placement group are gone


def test_groups_are_removed_by_name_prefix_and_no_others() -> None:
    """What a batch driver does after a pass: its engines' groups (one pending, one ready) go, a neighbour's stays."""
    ours = [ray.util.placement_group([{"CPU": 1}], name="raytp-batch-ab12-e1")]
    ray.get(ours[0].ready(), timeout=30)
    ours.append(ray.util.placement_group([{"CPU": 99}], name="raytp-batch-ab12-e2"))  # never fits: pending
    neighbour = ray.util.placement_group([{"CPU": 1}], name="raytp-batch-cd34-e1")
    try:
        assert remove_groups_named("raytp-batch-ab12-") == ["raytp-batch-ab12-e1", "raytp-batch-ab12-e2"]
        states = {info["name"]: info["state"] for info in ray.util.placement_group_table().values()}
        assert [states[f"raytp-batch-ab12-e{i}"] for i in (1, 2)] == ["REMOVED", "REMOVED"]
        assert states["raytp-batch-cd34-e1"] != "REMOVED"
        assert remove_groups_named("raytp-batch-ab12-") == []
    finally:
        for pg in (*ours, neighbour):
            ray.util.remove_placement_group(pg)
