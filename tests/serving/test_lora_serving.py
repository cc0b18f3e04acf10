"""LoRA adapters over HTTP, as vLLM users know them, on a live server with two model replicas: once in the
default topology (each ingress replica hosts its engine), once as one of two models (two ingress replicas
in front of the model's two LLMServer replicas, and another model beside it).

`--lora-modules` adapters are served by name (completions and chat, streamed or not) with exactly the
offline engine's output for that adapter; `POST /v1/load_lora_adapter` / `unload_lora_adapter` change what
every replica serves (the POST reaches one ingress replica; the LoRARegistry carries it to the other);
a bad path, a rank over max_lora_rank or a taken name is a 400 naming it and the server keeps serving.
The refusal with runtime updating off is checked on the multi-model server (test_multi_model.py).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import requests
from ray import serve

from raytp import LLM, LoRARequest, SamplingParams
from tests.helpers.lora_models import make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama
from tests.serving.live_server import APP, LiveServer, live_server, sse_payloads

ENGINE = {"max_model_len": 256, "kv_cache_memory_bytes": 1 << 24, "swap_space": 0.05}
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
PROMPT = "hello there"
MESSAGES = [{"role": "user", "content": "hi"}]
REPLICAS = 2
TRIES = 6  # requests per check: with two replicas behind HAProxy, both are reached


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_llama(root / "model")
    return {
        "model": model,
        "sql": make_peft_adapter(model, root / "sql", rank=8, seed=1),
        "tuned": make_peft_adapter(model, root / "tuned", rank=4, seed=2),
        "wide": make_peft_adapter(model, root / "wide", rank=32, seed=3),  # over max_lora_rank
    }


@pytest.fixture(scope="module")
def expected(paths: dict[str, str]) -> dict[str, Any]:
    """The offline engine's greedy answers per adapter (before the server takes the CPUs)."""
    llm = LLM(paths["model"], **ENGINE, **LORA)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    try:
        out: dict[str, Any] = {"base": llm.generate([PROMPT], greedy)[0].outputs[0].text}
        for i, name in enumerate(("sql", "tuned"), start=1):
            lora = LoRARequest(name, i, paths[name])
            out[name] = llm.generate([PROMPT], greedy, lora_request=lora)[0].outputs[0].text
            out[f"{name}-chat"] = llm.chat(MESSAGES, greedy, lora_request=lora)[0].outputs[0].text
    finally:
        llm.llm_engine.shutdown()
    assert len({out["base"], out["sql"], out["tuned"]}) == 3, "the adapters must change the output"
    return out


@pytest.fixture(scope="module", params=["default", "two-models"])
def server(request: pytest.FixtureRequest, paths: dict[str, str], expected: dict[str, Any]) -> Any:
    tiny = {
        "model": paths["model"],
        "served_model_name": "tiny",
        "num_replicas": REPLICAS,
        "lora_modules": [f"sql={paths['sql']}"],
        **LORA,
    }
    if request.param == "default":  # two ingress replicas hosting their engines, behind HAProxy
        args = {**tiny, "split_ingress": False, "enable_runtime_lora_updating": True, **ENGINE}
    else:
        other = {"model": paths["model"], "served_model_name": "other", "num_replicas": 1}
        args = {"models": [tiny, other], "ingress_replicas": REPLICAS, "enable_runtime_lora_updating": True, **ENGINE}
    with live_server(args, num_cpus=REPLICAS + 3) as s:
        if request.param != "default":
            s.engine_deployment = "LLMServer:tiny"
        yield s


def base_names(server: LiveServer) -> set[str]:
    return {"tiny"} if server.engine_deployment == "OpenAIIngress" else {"tiny", "other"}


def complete(server: LiveServer, model: str, **extra: Any) -> requests.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    return requests.post(server.url("/v1/completions"), json=body, timeout=120)


def post(server: LiveServer, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(server.url(path), json=body, timeout=120)


def names_per_replica() -> dict[str, set[str]]:
    """What each ingress replica routes, asked until both replicas answered (Serve's handle picks one of
    two at random per call)."""
    handle = serve.get_deployment_handle("OpenAIIngress", APP)
    seen: dict[str, set[str]] = {}
    for _ in range(64):
        replica, names = handle.served_names.remote().result(timeout_s=30)
        seen[replica] = set(names)
        if len(seen) == REPLICAS:
            return seen
    raise AssertionError(f"only {len(seen)} of {REPLICAS} ingress replicas answered")


def test_lora_modules_are_served_by_name(server: LiveServer, paths: dict[str, str], expected: dict[str, Any]) -> None:
    models = {m["id"]: m for m in requests.get(server.url("/v1/models"), timeout=30).json()["data"]}
    assert set(models) == base_names(server) | {"sql"}
    assert (models["sql"]["parent"], models["sql"]["root"]) == ("tiny", paths["sql"])
    for _ in range(TRIES):
        r = complete(server, "sql")
        assert r.status_code == 200, r.text
        assert (r.json()["model"], r.json()["choices"][0]["text"]) == ("sql", expected["sql"])
    assert complete(server, "tiny").json()["choices"][0]["text"] == expected["base"]
    chat = {"model": "sql", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected["sql-chat"]
    with requests.post(
        server.url("/v1/chat/completions"), json={**chat, "stream": True}, stream=True, timeout=120
    ) as s:
        events = sse_payloads(s)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == expected["sql-chat"] and {e["model"] for e in events[:-1]} == {"sql"}


def test_load_and_unload_at_runtime_reach_every_replica(
    server: LiveServer, paths: dict[str, str], expected: dict[str, Any]
) -> None:
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": paths["tuned"]})
    assert r.status_code == 200, r.text
    assert all(names == base_names(server) | {"sql", "tuned"} for names in names_per_replica().values())
    for _ in range(TRIES):  # whichever ingress replica HAProxy picks knows the name, its engine serves it
        r = complete(server, "tuned", stream=True)
        assert r.status_code == 200, r.text
        events = sse_payloads(r)
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == expected["tuned"]
        listed = requests.get(server.url("/v1/models/tuned"), timeout=30).json()
        assert (listed["parent"], listed["root"]) == ("tiny", paths["tuned"])
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "tuned"})
    assert r.status_code == 200, r.text
    assert all(names == base_names(server) | {"sql"} for names in names_per_replica().values())
    for _ in range(TRIES):
        r = complete(server, "tuned")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert "tuned" not in {m["id"] for m in requests.get(server.url("/v1/models"), timeout=30).json()["data"]}
    again = post(server, "/v1/unload_lora_adapter", {"lora_name": "tuned"})
    assert again.status_code == 404 and "tuned" in again.json()["error"]["message"]
    # The name is free again: loading it anew serves the same checkpoint under a fresh id. The POST answers
    # once the ingress replica that took it routes the name; the other one follows within a registry round
    # trip (docs/architecture.md), so wait for it before a request that HAProxy may send there (one CI run
    # on a loaded machine got there first: a 404).
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": paths["tuned"]})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while not all("tuned" in names for names in names_per_replica().values()):
        assert time.monotonic() < deadline, "the other ingress replica never routed the reloaded adapter"
        time.sleep(0.1)
    assert complete(server, "tuned").json()["choices"][0]["text"] == expected["tuned"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "tuned"}).status_code == 200


@pytest.mark.parametrize(
    ("name", "path", "named"),
    [
        ("ghost", "/nonexistent/adapter", ["ghost", "/nonexistent/adapter"]),
        ("wide", "wide", ["wide", "rank"]),
        ("sql", "tuned", ["sql", "already been loaded"]),
        ("tiny", "tuned", ["tiny", "base model"]),
    ],
    ids=["bad-path", "rank-over-max", "adapter-name-taken", "base-name-taken"],
)
def test_a_bad_adapter_is_a_400_naming_it_and_the_server_serves_on(
    server: LiveServer, paths: dict[str, str], expected: dict[str, Any], name: str, path: str, named: list[str]
) -> None:
    r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": paths.get(path, path)})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(word in message for word in named), message
    names = {m["id"] for m in requests.get(server.url("/v1/models"), timeout=30).json()["data"]}
    assert names == base_names(server) | {"sql"}
    r = complete(server, "sql")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["sql"]


def test_load_needs_both_fields(server: LiveServer) -> None:
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_an_adapter_for_a_model_without_lora_is_refused(server: LiveServer, paths: dict[str, str]) -> None:
    if server.engine_deployment == "OpenAIIngress":
        pytest.skip("one model")
    body = {"lora_name": "x", "lora_path": paths["tuned"], "base_model_name": "other"}
    r = post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400 and "enable_lora" in r.json()["error"]["message"]


def test_no_kv_block_leaks(server: LiveServer) -> None:
    """Every request above (adapters, refusals, unloads) gave its blocks back."""
    server.wait_idle()
