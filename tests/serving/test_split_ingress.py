"""`split_ingress`: the OpenAI ingress as its own deployment in front of `LLMServer` model replicas.

The default app (every other serving test) runs each model replica's engine inside the ingress
replica; this module runs the other topology live on a tiny random-weight Llama: answers equal the
offline engine's, the engine's stats come from the LLMServer replica, and a dead engine is a 503
at the (healthy) ingress until Serve replaces the LLMServer replica.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import ray
import requests
from ray import serve

from raytp import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_llama
from tests.serving.live_server import APP, LiveServer, live_server

ENGINE = {"max_model_len": 256, "kv_cache_memory_bytes": 1 << 24, "swap_space": 0.05}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def expected(model_dir: str) -> str:
    """The offline engine's greedy text (computed before the server takes the machine's CPUs)."""
    llm = LLM(model_dir, **ENGINE)
    try:
        return llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def server(model_dir: str, expected: str) -> Any:
    args = {"model": model_dir, **ENGINE, "split_ingress": True, "health_check_period_s": 1.0}
    with live_server(args) as s:
        yield s


def complete(server: LiveServer) -> requests.Response:
    body = {"model": model_name(server), "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    return requests.post(server.url("/v1/completions"), json=body, timeout=60)


def model_name(server: LiveServer) -> str:
    return str(requests.get(server.url("/v1/models"), timeout=30).json()["data"][0]["id"])


def test_answers_come_from_the_llmserver_replica(server: LiveServer, expected: str) -> None:
    r = complete(server)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    stats = server.wait_idle()  # from LLMServer: the ingress hosts no engine
    assert stats.num_device_blocks > 0 and stats.generation_tokens_total >= 8
    with pytest.raises(RuntimeError, match="hosts no engine"):
        serve.get_deployment_handle("OpenAIIngress", APP).get_stats.remote().result(timeout_s=30)


def test_a_dead_engine_is_a_503_until_its_replica_is_replaced(server: LiveServer, expected: str) -> None:
    pattern = re.compile(r"raytp-[0-9a-f]{8}-rank\d+")
    (worker,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if pattern.fullmatch(a["name"])]
    ray.kill(ray.get_actor(worker["name"], namespace=worker["namespace"]))
    r = requests.get(server.url("/health"), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    deadline = time.monotonic() + 120
    while requests.get(server.url("/health"), timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the LLMServer replica was not replaced"
        time.sleep(0.5)
    r = complete(server)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
