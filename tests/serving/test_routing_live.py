"""PrefixAwareRouter live: a `split_ingress` app with 2 LLMServer replicas of a tiny model. A conversation
whose every turn resends its history lands on one replica, whose engine then finds the history cached."""

from __future__ import annotations

from typing import Any

import pytest
import requests
from ray import serve

from cluster.loop_records import LoopStats
from tests.helpers.tiny_models import make_tiny_llama
from tests.serving.live_server import APP, LiveServer, live_server

# block_size 16: the router keys 16-token blocks, as the engine; the byte tokenizer makes a longer text's
# tokens extend a shorter one's.
ENGINE = {"max_model_len": 512, "block_size": 16, "kv_cache_memory_bytes": 1 << 24, "swap_space": 0.05}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    args = {"model": model, **ENGINE, "split_ingress": True, "num_replicas": 2, "request_router": "prefix"}
    with live_server(args) as s:
        yield s


def replica_stats() -> list[LoopStats]:
    """get_stats of both replicas. A handle cannot name a replica; calls other than `generate` go to a
    random one, so 40 calls reach both unless one is missed 40 times (2**-39). Replicas are told apart by
    their counters, which differ once either has served a request."""
    handle = serve.get_deployment_handle("LLMServer", APP)
    seen: dict[tuple[int, ...], LoopStats] = {}
    for _ in range(40):
        st: LoopStats = handle.get_stats.remote().result(timeout_s=30)
        seen[(st.prompt_tokens_total, st.generation_tokens_total, st.prefix_cache_queries)] = st
    return list(seen.values())


def test_a_conversation_stays_on_one_replica_and_hits_its_prefix_cache(server: LiveServer) -> None:
    name = requests.get(server.url("/v1/models"), timeout=30).json()["data"][0]["id"]
    history = "system: you are a terse assistant who answers in one word. " * 2
    for turn in range(4):
        history += f"user: question number {turn}, please answer it. assistant:"
        body = {"model": name, "prompt": history, "max_tokens": 4, "temperature": 0}
        r = requests.post(server.url("/v1/completions"), json=body, timeout=60)
        assert r.status_code == 200, r.text
        history += r.json()["choices"][0]["text"] + "\n"
    stats = replica_stats()
    assert len(stats) == 2, f"expected two distinct replicas, got {stats}"
    served = [s for s in stats if s.prompt_tokens_total > 0]
    assert len(served) == 1, f"the conversation was split over the replicas: {stats}"
    (st,) = served
    # Turns 2-4 find at least the previous turn's full prompt blocks cached (turn 1's prompt is 128 bytes).
    assert st.prefix_cache_hits >= 3 * 128 // 16 * 16, st
    assert st.prefix_cache_hit_rate > 0.4, st
