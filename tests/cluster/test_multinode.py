"""Two simulated Ray nodes (ray.cluster_utils.Cluster): the placement strategy decides where ranks go.

Each node has 2 CPUs, so TP=2 fits on either node alone: PACK keeps both ranks on one node,
SPREAD puts one on each, and both give HF's greedy tokens. STRICT_SPREAD over more ranks than
nodes is refused up front.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.placement import PlacementError
from cluster.ray_executor import RayExecutor
from raytp import LLM
from tests.cluster.ray_helpers import assert_all_blocks_free, assert_nothing_left, generate_ids, live_placement_groups
from tests.cluster.reference import hf_greedy
from tests.helpers.tiny_models import make_tiny_llama, make_tiny_qwen2

MAX_NEW = 32
CONFIG = dict(block_size=4, kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_qwen2(Path(tmp_path_factory.mktemp("models")))


def _prompts() -> list[list[int]]:
    return [[(11 * i + 5 * j) % 250 + 3 for j in range(4 + 9 * i)] for i in range(4)]


@pytest.mark.parametrize(("strategy", "same_node"), [("SPREAD", False), ("PACK", True)])
def test_strategy_places_ranks_and_tokens_match(two_nodes: Cluster, model: str, strategy: str, same_node: bool) -> None:
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    before = live_placement_groups()
    llm = LLM(model, tensor_parallel_size=2, placement_strategy=strategy, **CONFIG)
    try:
        executor = llm.llm_engine.executor
        assert isinstance(executor, RayExecutor)
        node_ids = [n.node_id for n in executor.nodes]
        assert (node_ids[0] == node_ids[1]) is same_node, f"{strategy} placed the ranks on {node_ids}"
        got = generate_ids(llm, _prompts(), MAX_NEW)
        assert_all_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()
    assert_nothing_left(before)
    assert got == hf_greedy(model, _prompts(), MAX_NEW)
    assert got == generate_ids(LLM(model, **CONFIG), _prompts(), MAX_NEW)  # TP=1, in-process


def test_strict_spread_over_more_ranks_than_nodes_is_refused(two_nodes: Cluster, tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path)  # 8 query / 4 KV heads: TP=4 divides them
    before = live_placement_groups()
    with pytest.raises(PlacementError, match=r"on 4 different nodes, but the cluster \(4 CPUs on 2 nodes\) has 2"):
        LLM(model, tensor_parallel_size=4, placement_strategy="STRICT_SPREAD")
    assert_nothing_left(before)
