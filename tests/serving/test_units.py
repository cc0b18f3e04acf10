"""The serving layer's pure parts, without a server: argument parsing, the example Serve config,
error mapping by type, logprob shapes. Milliseconds each."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from cluster.engine import EngineDeadError
from cluster.outputs import Logprob
from raytp.openai.errors import EngineOverloadedError, request_failed, to_openai_error, validation_error
from raytp.openai.logprobs import chat_logprobs, completion_logprobs
from raytp.openai.protocol import CompletionRequest
from raytp.serve.app import build_app, engine_deployment
from raytp.serve.args import ServeArgs
from request.errors import PromptTooLongError, RequestError

ROOT = Path(__file__).resolve().parents[2]


def test_serve_args_parsing() -> None:
    sa = ServeArgs.from_dict({"model": "m", "tensor_parallel_size": 2, "num_replicas": 3, "api_key": "k"})
    m = sa.model
    assert m.engine.model == "m" and m.engine.tensor_parallel_size == 2 and m.num_replicas == 3
    # 2+ replicas run split, so Serve's prefix router picks each request's replica; one replica, or
    # split_ingress=False, stays behind HAProxy.
    assert sa.split and not ServeArgs.from_dict({"num_replicas": 1}).split
    assert ServeArgs.from_dict({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}).split
    assert not ServeArgs.from_dict({"autoscaling_config": {"min_replicas": 1}}).split  # Serve's max_replicas: 1
    assert not ServeArgs.from_dict({"num_replicas": 3, "split_ingress": False}).split
    with pytest.raises(ValueError, match="request_router needs the split topology"):
        ServeArgs.from_dict({"num_replicas": 3, "split_ingress": False, "request_router": "pow2"})
    with pytest.raises(ValueError, match="several models always run split"):
        ServeArgs.from_dict(
            {"models": [{"served_model_name": "a"}, {"served_model_name": "b"}], "split_ingress": False}
        )
    with pytest.raises(ValueError, match="unknown serve arguments: tensor_paralel_size"):
        ServeArgs.from_dict({"tensor_paralel_size": 2})
    with pytest.raises(ValueError, match="exclusive"):
        ServeArgs.from_dict({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}})
    with pytest.raises(ValueError, match="block_size"):
        ServeArgs.from_dict({"block_size": 3})
    # Without split_ingress the model replicas serve HTTP themselves: a count of ingress replicas is a mistake.
    with pytest.raises(ValueError, match="ingress_replicas needs split_ingress"):
        ServeArgs.from_dict({"ingress_replicas": 2})
    assert ServeArgs.from_dict({"split_ingress": True, "ingress_replicas": 2}).ingress_replicas == 2


def test_a_model_replica_reserves_its_model_only_when_the_model_runs_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """In TP worker actors the workers' placement group holds the compute, so the replica reserves none; run
    in-process, the replica holds what the one rank's bundle would (CPUs, and a GPU on CUDA)."""
    monkeypatch.setenv("RAYTP_CPUS_PER_WORKER", "3")

    def resources(**engine: object) -> dict[str, float]:
        sa = ServeArgs.from_dict(dict(engine))
        return engine_deployment(sa, sa.model)["ray_actor_options"]

    assert resources() == {"num_cpus": 0}
    assert resources(tensor_parallel_size=2) == {"num_cpus": 0}
    assert resources(distributed_executor_backend="inprocess", device="cpu") == {"num_cpus": 3.0}
    assert resources(distributed_executor_backend="inprocess", device="cuda") == {"num_cpus": 3.0, "num_gpus": 1}


@pytest.mark.parametrize("name", ["serve_config.example.yaml", "serve_config.multi.example.yaml"])
def test_example_serve_config_is_valid(name: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / name).read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "serve_app:build_app"
    build_app(app.args)  # every arg is accepted


def test_errors_map_by_type_not_by_message() -> None:
    e = to_openai_error(RequestError("anything at all", "temperature"))
    assert (e.status, e.param, e.type) == (400, "temperature", "invalid_request_error")
    too_long = to_openai_error(PromptTooLongError("whatever the wording"))
    assert (too_long.status, too_long.param, too_long.code) == (400, "prompt", "context_length_exceeded")
    assert to_openai_error(EngineOverloadedError("busy")).status == 503
    dead = to_openai_error(EngineDeadError("rank 1 (pid 13374 on 192.0.2.2) died"))
    assert dead.status == 503 and "13374" not in dead.message and "192.0.2.2" not in dead.message
    failed = request_failed("engine failure: tensor-parallel rank 1 (pid 13374 on 192.0.2.2)", "cmpl-1")
    assert failed.status == 503 and "192.0.2.2" not in failed.message
    internal = to_openai_error(KeyError("secret internals"))
    assert internal.status == 500 and "KeyError" not in internal.message and "secret" not in internal.message


def test_request_errors_survive_pickling() -> None:
    """They cross Ray (controller -> ingress) with their fields."""
    e = pickle.loads(pickle.dumps(PromptTooLongError("too long", "messages")))
    assert isinstance(e, PromptTooLongError) and (e.message, e.param, e.code) == (
        "too long",
        "messages",
        "context_length_exceeded",
    )


def test_validation_errors_name_the_field() -> None:
    """Regression (issue 7, bug 6): the assertions used to sit in an `except` block that never ran
    when nothing was raised."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": [1.5]})
    err = validation_error(info.value.errors())
    assert err.status == 400 and err.param == "prompt"
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "hi", "temperature": float("inf")})
    assert validation_error(info.value.errors()).param == "temperature"


def test_logprob_shapes() -> None:
    texts = {5: "a", 6: "bc", 7: "d"}

    def entry(**ranks: tuple[float, int]) -> dict[int, Logprob]:
        return {int(t[1:]): Logprob(lp, r, texts[int(t[1:])]) for t, (lp, r) in ranks.items()}

    entries = [None, entry(t6=(-0.5, 1), t7=(-1.5, 2)), entry(t7=(-3.0, 3), t5=(-0.1, 1), t6=(-0.2, 2))]
    lp = completion_logprobs([5, 6, 7], entries, 1, 10, texts.__getitem__)
    assert lp.tokens == ["a", "bc", "d"] and lp.text_offset == [10, 11, 13]
    assert lp.token_logprobs == [None, -0.5, -3.0]
    assert lp.top_logprobs == [None, {"bc": -0.5}, {"a": -0.1, "d": -3.0}]  # top-1 plus the sampled token
    chat = chat_logprobs([7], [entry(t7=(float("-inf"), 3), t5=(-0.1, 1), t6=(-0.2, 2))], 2)
    (only,) = chat.content or []
    assert only.logprob == -9999.0 and [t.token for t in only.top_logprobs] == ["a", "bc"]


def test_the_http_app_and_batch_lines_take_the_route_table() -> None:
    """One table: the app's POST routes are its rows, each validating with its row's model, and a batch
    line may name each of them (and nothing else)."""
    import json
    from typing import Any, cast

    from fastapi.routing import APIRoute

    from raytp.batch.input import BatchError, BatchRow, parse_line
    from raytp.openai.app import openai_app
    from raytp.openai.context import ServingContext
    from raytp.openai.models import ServedModels
    from raytp.openai.routes import ROUTES

    async def healthy() -> None:
        return None

    ctx = ServingContext(cast(Any, None), None, "m", max_model_len=8, vocab_size=8, max_token_chars=1)
    app = openai_app(ServedModels([ctx]), healthy, api_key=None)  # nothing touches the engine until a request
    posts = {r.path: r.methods for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods}
    # the table's rows, and the runtime LoRA routes (the app's own: batch jobs do not load adapters)
    lora_routes = {"/v1/load_lora_adapter": {"POST"}, "/v1/unload_lora_adapter": {"POST"}}
    assert posts == {r.path: {r.method} for r in ROUTES} | lora_routes
    spec = app.openapi()
    for r in ROUTES:
        body = spec["paths"][r.path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/" + r.request.__name__), r.path

    def line(url: str) -> str:
        return json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": {}})

    assert all(isinstance(parse_line(1, line(r.path)), BatchRow) for r in ROUTES)
    refused = parse_line(1, line("/v1/audio/transcriptions"))
    assert isinstance(refused, BatchError) and refused.code == "invalid_url"
