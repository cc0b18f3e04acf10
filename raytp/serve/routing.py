"""PrefixAwareRouter: the Serve request router of the `LLMServer` deployment (`split_ingress`) that sends a
request where its prompt's prefix is most likely cached, unless that replica is too busy.

A request's key is the chain of its prompt's full-block hashes (kv/prefix_cache.py's `hash_block`, the
engine's own chaining), rooted at its LoRA adapter: the same tokens under two adapters never share KV, so
they never share keys. The router remembers, per replica, the keys it sent there (an LRU bounded per
replica) and reads the replicas' queue lengths from Serve's queue-length cache (probing the ones it lacks).

Policy (`rank_replicas`, a pure function; its bounds are `RoutingPolicy`):
- the replica holding the longest matching prefix, if that prefix covers at least `min_match_ratio` of
  the prompt's blocks and its queue is at most the shortest queue plus `imbalance_threshold`;
- otherwise (too busy, a short match, or none) the least loaded replica, ties broken at random.
A hot prefix therefore spills to a second replica once its first holds `imbalance_threshold` more requests
than the least loaded one; that replica then caches it too, and both match from then on.

Decisions:
- The table is what this router sent, not what the engines hold: an engine may have evicted the blocks
  (its KV pool is the bound, not the table). Asking the engines on every request would cost a Ray message
  per replica per request; a stale entry costs one prefill that a cache-blind router would pay anyway.
- The state lives in each router, i.e. in each ingress replica's handle: with several ingress replicas
  each learns from the requests it routes (no shared actor on the request path).
- Block size: the engine's when it is configured; else 16 tokens (`DEFAULT_ROUTING_BLOCK_SIZE`): the
  router runs in the ingress, which does not know the device the engines resolved (128 on CPU, 16 or 256
  on CUDA), and 16 divides each, so every prefix the engine can reuse is matched here and ranked in the
  same order. The price: a match shorter than one engine block counts here and saves nothing there;
  `min_match_ratio` keeps such short matches from deciding.
- Only prompts are keyed, not the answers the engine also caches: a turn whose previous answer is longer
  than the rest of the history falls under `min_match_ratio` and goes least loaded.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ray.serve._private.replica_result import ReplicaResult
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kv.prefix_cache import BlockHash, hash_block

if TYPE_CHECKING:
    from raytp.openai.engine_client import EngineRequest

DEFAULT_ROUTING_BLOCK_SIZE = 16
DEFAULT_MAX_BLOCKS_PER_REPLICA = 1 << 16  # 64 Ki keys (~10 MiB with the dict) per replica and router
DEFAULT_IMBALANCE_THRESHOLD = 8  # requests in flight (Serve's queue length) over the least loaded replica
GENERATE_METHOD = "generate"  # the LLMServer method whose requests are keyed; all others go least loaded

DEFAULT_MIN_MATCH_RATIO = 0.5  # of the prompt's blocks; SGLang's router's cache_threshold

R = TypeVar("R", bound=Hashable)


@dataclass(frozen=True)
class RoutingPolicy:
    """When affinity wins over load: both bounds must hold for the replica with the longest match."""

    # Most requests (Serve's queue length: in flight at the replica) the holder may have over the least
    # loaded replica; above it the request goes least loaded, and the prefix gets a second holder.
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD
    # Least share of the prompt's blocks the match must cover. Below it the match is a shared preamble (a
    # system prompt every replica soon holds) rather than this conversation: following it would pile
    # every new conversation onto whichever replica served the first one.
    min_match_ratio: float = DEFAULT_MIN_MATCH_RATIO

    def __post_init__(self) -> None:
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be non-negative, got {self.imbalance_threshold}.")
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {self.min_match_ratio}.")


def prompt_keys(token_ids: Sequence[int], block_size: int, adapter_id: int | None) -> list[BlockHash]:
    """Chained keys of the prompt's full blocks; the chain's root is the adapter (None: the base model)."""
    parent: BlockHash | None = None if adapter_id is None else hash_block(None, [-1, adapter_id])
    keys: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


class PrefixTable(Generic[R]):
    """Per replica, the block keys routed there, least recently routed evicted first."""

    def __init__(self, max_blocks_per_replica: int) -> None:
        if max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica must be at least 1, got {max_blocks_per_replica}.")
        self._max = max_blocks_per_replica
        self._keys: dict[R, OrderedDict[BlockHash, None]] = {}

    def record(self, replica: R, keys: Sequence[BlockHash]) -> None:
        table = self._keys.setdefault(replica, OrderedDict())
        # Invariant: a prompt's leading key is its most recently used one (touched last), so eviction takes
        # a chain from its tail; a chain cut at its head would make every later key unmatchable.
        for key in reversed(keys):
            table[key] = None
            table.move_to_end(key)
        while len(table) > self._max:
            table.popitem(last=False)

    def matches(self, keys: Sequence[BlockHash], replicas: Iterable[R]) -> dict[R, int]:
        """Leading keys of `keys` recorded for each replica (0 for a replica with none)."""
        out: dict[R, int] = {}
        for replica in replicas:
            table = self._keys.get(replica)
            n = 0
            if table is not None:
                for key in keys:
                    if key not in table:
                        break  # chained keys: nothing after a miss can match
                    n += 1
            out[replica] = n
        return out

    def retain(self, replicas: Iterable[R]) -> None:
        """Forget every replica not in `replicas` (it left the deployment)."""
        keep = set(replicas)
        for gone in [r for r in self._keys if r not in keep]:
            del self._keys[gone]

    def num_blocks(self, replica: R) -> int:
        return len(self._keys.get(replica, ()))

    def replicas(self) -> set[R]:
        return set(self._keys)


def rank_replicas(
    candidates: Sequence[R],
    matched_blocks: Mapping[R, int],
    num_blocks: int,
    queue_lens: Mapping[R, int | None],
    policy: RoutingPolicy,
    rng: random.Random,
) -> list[list[R]]:
    """[[the chosen replica], the others]: Serve sends to the first rank with room (the others only when
    the chosen one refuses, its queue full). `num_blocks`: the request's full blocks, of which
    `matched_blocks` counts the leading ones each replica holds. A replica whose queue length is unknown
    counts as empty (Serve probes it before sending)."""
    if not candidates:
        return []
    load = {r: queue_lens.get(r) or 0 for r in candidates}
    least = min(load.values())
    shuffled = list(candidates)
    rng.shuffle(shuffled)  # ties go to a random replica, not the first listed
    best = max((matched_blocks.get(r, 0) for r in candidates), default=0)
    pool = shuffled
    if best > 0 and best >= policy.min_match_ratio * num_blocks:
        bound = least + policy.imbalance_threshold
        holders = [r for r in shuffled if matched_blocks.get(r, 0) == best and load[r] <= bound]
        pool = holders or shuffled
    chosen = min(pool, key=lambda r: load[r])  # the first of the least loaded: a random one of them
    rest = [r for r in shuffled if r != chosen]
    return [[chosen], rest] if rest else [[chosen]]


def adapter_id(request: EngineRequest) -> int | None:
    """The LoRA adapter an engine request (the one argument of `LLMServer.generate`) runs with; None: none."""
    lora = request.lora_request
    return None if lora is None else int(lora.lora_int_id)


class PrefixAwareRouter(RequestRouter):
    """Serve request router of `LLMServer`: prefix affinity with a load bound (module docstring).

    Serve builds it in every process holding a handle to the deployment, with `initialize_state` given
    `RequestRouterConfig.request_router_kwargs`.
    """

    def initialize_state(  # type: ignore[override]
        self,
        block_size: int = DEFAULT_ROUTING_BLOCK_SIZE,
        max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
        min_match_ratio: float = DEFAULT_MIN_MATCH_RATIO,
        seed: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self._block_size = block_size
        self._policy = RoutingPolicy(imbalance_threshold, min_match_ratio)
        self._table: PrefixTable[ReplicaID] = PrefixTable(max_blocks_per_replica)
        self._rng = random.Random(seed)

    def _keys(self, pending_request: PendingRequest | None) -> list[BlockHash]:
        """The request's block keys; none for calls other than `generate` (health, stats, model_info)."""
        if pending_request is None or pending_request.metadata.call_method != GENERATE_METHOD:
            return []
        args, kwargs = pending_request.args, pending_request.kwargs
        request: EngineRequest | None = kwargs.get("request", args[0] if args else None)
        if request is None:
            return []
        return prompt_keys(request.prompt_token_ids, self._block_size, adapter_id(request))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        keys = self._keys(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        matched = self._table.matches(keys, by_id) if keys else {}
        queue_lens = await self._queue_lens(candidate_replicas)
        ranks = rank_replicas(list(by_id), matched, len(keys), queue_lens, self._policy, self._rng)
        if keys and ranks:
            # Recorded now, not only once the replica accepts (`on_request_routed`, a round trip later):
            # requests that arrive together with one new prefix then go where the first of them went.
            self._table.record(ranks[0][0], keys)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int | None]:
        """Queue lengths from Serve's cache; replicas missing there are probed (as Serve's own routers do)."""
        out: dict[ReplicaID, int | None] = {
            r.replica_id: self.replica_queue_len_cache.get(r.replica_id) for r in replicas
        }
        missing = [r for r in replicas if out[r.replica_id] is None]
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                out[replica.replica_id] = queue_len
        return out

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        # Where the request went, if the chosen replica refused it (full) and a later rank took it.
        keys = self._keys(pending_request)
        if keys:
            self._table.record(replica_id, keys)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._table.retain(r.replica_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._table.retain(self.curr_replicas)


def request_router_config(name: str, block_size: int | None) -> RequestRouterConfig:
    """The LLMServer deployment's router: `name` is ServeArgs.request_router; `block_size` the engine's
    configured one (None: its device default, which DEFAULT_ROUTING_BLOCK_SIZE divides)."""
    if name == "pow2":
        return RequestRouterConfig()  # Serve's default, PowerOfTwoChoicesRequestRouter
    if name != "prefix":
        raise ValueError(f"unknown request router {name!r}: prefix or pow2")
    # Passed as keywords of type Any: Ray 2.60 annotates RequestRouterConfig's **kwargs as dicts.
    options: dict[str, Any] = {
        "request_router_class": f"{__name__}.{PrefixAwareRouter.__name__}",
        "request_router_kwargs": {"block_size": block_size or DEFAULT_ROUTING_BLOCK_SIZE},
    }
    return RequestRouterConfig(**options)
