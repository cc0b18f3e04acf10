"""The prefix-aware routing policy (raytp/serve/routing.py) without Serve running: keys, the per-replica
table, the ranking, and the router class driven through Serve's RequestRouter interface with stand-in
replicas (queue lengths set in its cache, as Serve's probes would)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from kv.prefix_cache import hash_full_blocks
from raytp.openai.engine_client import EngineRequest
from raytp.serve.routing import (
    PrefixAwareRouter,
    PrefixTable,
    RoutingPolicy,
    adapter_id,
    prompt_keys,
    rank_replicas,
    request_router_config,
)
from request.lora import LoRARequest
from request.sampling_params import SamplingParams

RNG = random.Random(0)


def test_keys_are_the_engines_block_chain_for_the_base_model() -> None:
    tokens = list(range(40))
    assert prompt_keys(tokens, 16, None) == hash_full_blocks(tokens, 16, [], 2)  # the partial block has no key


def test_an_adapter_roots_its_own_chain() -> None:
    tokens = list(range(32))
    base, a1, a2 = prompt_keys(tokens, 16, None), prompt_keys(tokens, 16, 1), prompt_keys(tokens, 16, 2)
    assert not set(base) & set(a1) and not set(a1) & set(a2)
    assert prompt_keys(tokens, 16, 1) == a1


def test_adapter_id_reads_the_generate_call() -> None:
    lora = LoRARequest("sql", 7, "/adapters/sql")
    assert adapter_id(EngineRequest("r", [1], SamplingParams())) is None
    assert adapter_id(EngineRequest("r", [1], SamplingParams(), lora)) == 7


def test_table_matches_the_longest_recorded_prefix_per_replica() -> None:
    table: PrefixTable[str] = PrefixTable(100)
    convo = list(range(64))
    table.record("a", prompt_keys(convo[:32], 16, None))
    table.record("b", prompt_keys(convo[:48], 16, None))
    assert table.matches(prompt_keys(convo, 16, None), ["a", "b", "c"]) == {"a": 2, "b": 3, "c": 0}
    other = list(range(100, 164))
    assert table.matches(prompt_keys(other, 16, None), ["a", "b"]) == {"a": 0, "b": 0}


def test_table_evicts_least_recently_routed_chains_from_their_tail() -> None:
    table: PrefixTable[str] = PrefixTable(4)
    old, new = list(range(48)), list(range(1000, 1032))
    table.record("a", prompt_keys(old, 16, None))  # 3 keys
    table.record("a", prompt_keys(new, 16, None))  # 2 keys: one of old's goes, its last
    assert table.num_blocks("a") == 4
    assert table.matches(prompt_keys(old, 16, None), ["a"]) == {"a": 2}
    assert table.matches(prompt_keys(new, 16, None), ["a"]) == {"a": 2}
    table.record("a", prompt_keys(old[:16], 16, None))  # touching a head keeps it past newer chains
    table.record("a", prompt_keys(list(range(2000, 2032)), 16, None))
    assert table.matches(prompt_keys(old, 16, None), ["a"])["a"] >= 1


def test_table_forgets_replicas_that_left() -> None:
    table: PrefixTable[str] = PrefixTable(10)
    table.record("a", prompt_keys(list(range(16)), 16, None))
    table.record("b", prompt_keys(list(range(16)), 16, None))
    table.retain(["b"])
    assert table.replicas() == {"b"}


def test_rank_prefers_the_longest_match_within_the_load_bound() -> None:
    policy = RoutingPolicy(imbalance_threshold=4)
    ranks = rank_replicas(["a", "b", "c"], {"a": 2, "b": 5, "c": 0}, 6, {"a": 0, "b": 3, "c": 0}, policy, RNG)
    assert ranks[0] == ["b"] and sorted(ranks[1]) == ["a", "c"]


def test_rank_spills_a_busy_holder_to_the_least_loaded() -> None:
    policy = RoutingPolicy(imbalance_threshold=8)
    assert rank_replicas(["a", "b"], {"a": 5, "b": 0}, 5, {"a": 9, "b": 0}, policy, RNG) == [["b"], ["a"]]
    # exactly at the bound still goes to the prefix
    assert rank_replicas(["a", "b"], {"a": 5, "b": 0}, 5, {"a": 8, "b": 0}, policy, RNG) == [["a"], ["b"]]


def test_rank_among_equal_holders_takes_the_least_loaded() -> None:
    policy = RoutingPolicy(imbalance_threshold=8)
    ranks = rank_replicas(["a", "b", "c"], {"a": 5, "b": 5, "c": 0}, 5, {"a": 3, "b": 1, "c": 0}, policy, RNG)
    assert ranks[0] == ["b"]


def test_rank_ignores_a_match_that_is_only_a_shared_preamble() -> None:
    policy = RoutingPolicy(min_match_ratio=0.5)
    assert rank_replicas(["a", "b"], {"a": 2, "b": 0}, 5, {"a": 1, "b": 0}, policy, RNG)[0] == ["b"]  # 2 of 5
    assert rank_replicas(["a", "b"], {"a": 3, "b": 0}, 5, {"a": 1, "b": 0}, policy, RNG)[0] == ["a"]  # 3 of 5


def test_rank_without_a_match_takes_the_least_loaded_ties_at_random() -> None:
    policy = RoutingPolicy()
    assert rank_replicas(["a", "b", "c"], {}, 3, {"a": 2, "b": None, "c": 1}, policy, RNG)[0] == ["b"]
    firsts = {rank_replicas(["a", "b"], {}, 3, {}, policy, random.Random(seed))[0][0] for seed in range(20)}
    assert firsts == {"a", "b"}
    assert rank_replicas([], {}, 3, {}, policy, RNG) == []


def test_policy_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="imbalance_threshold"):
        RoutingPolicy(imbalance_threshold=-1)
    with pytest.raises(ValueError, match="min_match_ratio"):
        RoutingPolicy(min_match_ratio=1.5)


def test_router_config_names() -> None:
    assert request_router_config("prefix", None).request_router_kwargs == {"block_size": 16}
    assert request_router_config("prefix", 128).request_router_kwargs == {"block_size": 128}
    assert "PowerOfTwo" in str(request_router_config("pow2", None).request_router_class)
    with pytest.raises(ValueError, match="request router"):
        request_router_config("round_robin", None)


@dataclass
class FakeReplica:
    """What the router reads of a RunningReplica."""

    replica_id: ReplicaID
    max_ongoing_requests: int = 100

    async def get_queue_len(self, deadline_s: float) -> int:  # Serve probes a replica it has just learnt of
        return 0


def _router(replicas: list[FakeReplica], threshold: int = 2) -> PrefixAwareRouter:
    router = PrefixAwareRouter(
        deployment_id=DeploymentID("LLMServer", "raytp"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(block_size=16, imbalance_threshold=threshold, seed=0)
    router.update_replicas(replicas)  # type: ignore[arg-type]
    return router


def _generate(prompt: list[int], method: str = "generate") -> PendingRequest:
    meta = RequestMetadata(request_id="r", internal_request_id="i", call_method=method)
    return PendingRequest(args=[EngineRequest("r", prompt, SamplingParams())], kwargs={}, metadata=meta)


async def _route(router: PrefixAwareRouter, pr: PendingRequest, accepted: bool = True) -> ReplicaID:
    """Serve's step: the first rank (one replica here) or, if it refuses, the next; then the routed hook,
    and the replica's queue grows by one."""
    ranks = await router.choose_replicas(router._replicas_list, pr)
    rid = (ranks[0] if accepted else ranks[1])[0].replica_id
    router.on_request_routed(pr, rid, None)  # type: ignore[arg-type]
    router.on_send_request(rid)
    return rid


def test_router_keeps_a_conversation_on_one_replica_and_bounds_its_load() -> None:
    async def run() -> None:
        a, b = (
            FakeReplica(ReplicaID("a", DeploymentID("LLMServer", "raytp"))),
            FakeReplica(ReplicaID("b", DeploymentID("LLMServer", "raytp"))),
        )
        router = _router([a, b], threshold=2)
        for r in (a, b):
            router.replica_queue_len_cache.update(r.replica_id, 0)
        convo = list(range(64))
        first = await _route(router, _generate(convo))
        for turn in range(2):  # each turn resends the history plus more; the queue stays within the bound
            convo += list(range(500 + 20 * turn, 520 + 20 * turn))
            assert await _route(router, _generate(convo)) == first
        # The holder now has 3 in flight, the other 0: over the bound of 2, the next turn spills, and the
        # prefix has two holders from then on.
        other = await _route(router, _generate(convo + [7] * 20))
        assert other != first
        assert router._table.matches(prompt_keys(convo, 16, None), [first, other]) == {first: 6, other: 6}
        # Requests arriving together with a new prefix follow the first of them, before any is accepted.
        burst = list(range(3000, 3064))
        ranks = [await router.choose_replicas(router._replicas_list, _generate(burst)) for _ in range(3)]
        assert len({r[0][0].replica_id for r in ranks}) == 1
        # A refused request is recorded where it went.
        fresh = list(range(4000, 4064))
        went = await _route(router, _generate(fresh), accepted=False)
        assert router._table.matches(prompt_keys(fresh, 16, None), [went])[went] == 4
        # Calls other than generate are not keyed.
        assert router._keys(_generate(convo, method="model_info")) == []
        # A replica that leaves is forgotten.
        router.update_replicas([b])  # type: ignore[list-item]
        assert router._table.replicas() <= {b.replica_id}

    asyncio.run(run())


def test_serve_args_request_router() -> None:
    from raytp.serve.args import ServeArgs

    assert ServeArgs.from_dict({"split_ingress": True}).request_router is None  # build_app: prefix
    assert ServeArgs.from_dict({"split_ingress": True, "request_router": "pow2"}).request_router == "pow2"
    with pytest.raises(ValueError, match="request_router must be one of prefix, pow2"):
        ServeArgs.from_dict({"split_ingress": True, "request_router": "round_robin"})
    with pytest.raises(ValueError, match="request_router needs the split topology"):
        ServeArgs.from_dict({"request_router": "prefix"})  # one replica: HAProxy forwards, nothing to route
    assert ServeArgs.from_dict({"num_replicas": 2, "request_router": "pow2"}).split  # 2+ replicas run split
