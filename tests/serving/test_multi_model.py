"""Two models behind one endpoint, from a Serve config YAML: one ingress routes each request by `model`
to that model's own LLMServer deployment.

Two tiny random-weight Llamas (different seeds, so their greedy outputs differ); each must answer exactly
as its own offline engine does, `/v1/models` lists both, and a name served by neither is a 404 naming both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

from raytp import LLM, SamplingParams
from raytp.cli.serve import config_args
from tests.helpers.tiny_models import make_tiny_llama
from tests.serving.live_server import APP, LiveServer, live_server, sse_payloads

ENGINE = {"max_model_len": 256, "kv_cache_memory_bytes": 1 << 24, "swap_space": 0.05}
PROMPT = "hello there"
NAMES = ("alpha", "beta")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {name: make_tiny_llama(tmp_path_factory.mktemp(name), seed=seed) for seed, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def expected(model_dirs: dict[str, str]) -> dict[str, str]:
    """Each model's offline greedy text (computed before the server takes the machine's CPUs)."""
    out = {}
    for name, path in model_dirs.items():
        llm = LLM(path, **ENGINE)
        try:
            out[name] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
        finally:
            llm.llm_engine.shutdown()
    assert out["alpha"] != out["beta"], "the two models must be told apart by their answers"
    return out


@pytest.fixture(scope="module")
def config_file(model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Serve config YAML as `serve run` takes it: import_path serve_app:build_app, args.models."""
    models = [{"model": model_dirs[n], "served_model_name": n, "num_replicas": 1} for n in NAMES]
    config = {
        "applications": [
            {
                "name": APP,
                "route_prefix": "/",
                "import_path": "serve_app:build_app",
                "args": {"models": models, **ENGINE},
            }
        ]
    }
    path = tmp_path_factory.mktemp("config") / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def server(config_file: Path, expected: dict[str, str]) -> Any:
    ServeDeploySchema.model_validate(yaml.safe_load(config_file.read_text()))  # Serve accepts the file
    with live_server(config_args(str(config_file))) as s:  # the args `raytp serve --config` takes from it
        yield s


def complete(server: LiveServer, model: str | None, **extra: Any) -> requests.Response:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return requests.post(server.url("/v1/completions"), json=body, timeout=120)


def test_one_engine_deployment_per_model(server: LiveServer) -> None:
    status = serve.status().applications[APP].deployments
    assert set(status) == {"OpenAIIngress", "LLMServer:alpha", "LLMServer:beta"}


def test_models_lists_both(server: LiveServer) -> None:
    data = requests.get(server.url("/v1/models"), timeout=30).json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("alpha", None), ("beta", None)]
    one = requests.get(server.url("/v1/models/beta"), timeout=30)
    assert one.status_code == 200 and one.json()["id"] == "beta" and one.json()["max_model_len"] == 256
    assert [m["quantization"] for m in data] == ["none", "none"]  # raytp's field: what the weights run
    missing = requests.get(server.url("/v1/models/gamma"), timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("name", NAMES)
def test_each_model_answers_as_its_own_engine(server: LiveServer, expected: dict[str, str], name: str) -> None:
    r = complete(server, name)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == name and r.json()["choices"][0]["text"] == expected[name]
    with requests.post(
        server.url("/v1/completions"),
        json={"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True},
        stream=True,
        timeout=120,
    ) as streamed:
        events = sse_payloads(streamed)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == expected[name]
    assert {e["model"] for e in events[:-1]} == {name}


def test_several_prompts_of_one_request_reach_the_model(server: LiveServer, expected: dict[str, str]) -> None:
    """One HTTP request's engine requests go through the model's deployment handle together (they once shared
    Serve's internal request id, and its router spun on them forever: raytp/openai/engine_client.py)."""
    r = complete(server, "alpha", prompt=[PROMPT, PROMPT, PROMPT])
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [expected["alpha"]] * 3


def test_unknown_model_is_a_404_naming_the_served_ones(server: LiveServer) -> None:
    r = complete(server, "gamma")
    assert r.status_code == 404
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert "gamma" in err["message"] and "`alpha`" in err["message"] and "`beta`" in err["message"]
    # With several models a request must name one.
    missing = complete(server, None)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def test_tokenize_takes_the_model_too(server: LiveServer) -> None:
    for name in NAMES:
        r = requests.post(server.url("/tokenize"), json={"model": name, "prompt": PROMPT}, timeout=30)
        assert r.status_code == 200 and r.json()["count"] > 0
        tokens = r.json()["tokens"]
        d = requests.post(server.url("/detokenize"), json={"model": name, "tokens": tokens}, timeout=30)
        assert d.status_code == 200 and PROMPT in d.json()["prompt"]
    r = requests.post(server.url("/tokenize"), json={"model": "gamma", "prompt": PROMPT}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_runtime_lora_routes_refuse_when_the_flag_is_off(server: LiveServer) -> None:
    """Not started with --enable-runtime-lora-updating: a 404 (as vLLM's absent routes) saying how to turn
    them on; nothing is loaded."""
    for path, body in [
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/somewhere"}),
        ("/v1/unload_lora_adapter", {"lora_name": "x"}),
    ]:
        r = requests.post(server.url(path), json=body, timeout=30)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "runtime_lora_updating_disabled" and "--enable-runtime-lora-updating" in err["message"]
