"""The multi-model front door's pure parts, without a server: ServedModels' routing by `model`, the
multi-model and LoRA arguments (ServeArgs, `raytp serve --config`, `--lora-modules`), and the LoRA registry
that carries runtime loads to every replica. Milliseconds each."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from raytp.cli.main import build_parser
from raytp.cli.serve import serve_args_of
from raytp.openai.context import ServingContext
from raytp.openai.errors import OpenAIError
from raytp.openai.models import Adapter, ServedModels
from raytp.serve.args import RUNTIME_LORA_ENV, LoRAModule, ServeArgs
from raytp.serve.lora_registry import LoRARegistry
from request.lora import LoRARequest


def ctx(name: str, quantization: str = "none") -> ServingContext:
    return ServingContext(
        cast(Any, None), None, name, max_model_len=64, vocab_size=8, max_token_chars=1, quantization=quantization
    )


def adapter(name: str, lora_id: int, base: str) -> Adapter:
    return Adapter(LoRARequest(name, lora_id, f"/adapters/{name}"), base)


def test_resolve_picks_the_model_or_the_adapter_by_name() -> None:
    models = ServedModels([ctx("a"), ctx("b")], [adapter("sql", 1, "a")])
    assert models.resolve("b").model_name == "b" and models.resolve("b").lora is None
    sql = models.resolve("sql")
    assert (sql.model_name, sql.lora, sql.max_model_len) == ("sql", LoRARequest("sql", 1, "/adapters/sql"), 64)
    assert sql.client is models.context("a").client  # the adapter runs on its base model's engine
    with pytest.raises(OpenAIError) as unknown:
        models.resolve("c")
    assert (unknown.value.status, unknown.value.code, unknown.value.param) == (404, "model_not_found", "model")
    assert all(f"`{n}`" in unknown.value.message for n in ("a", "b", "sql"))
    with pytest.raises(OpenAIError) as missing:  # several models: a request must name one
        models.resolve(None)
    assert missing.value.status == 400 and missing.value.param == "model"
    assert ServedModels([ctx("only")]).resolve(None).model_name == "only"  # one model: the omission is it


def test_adapter_table_and_cards() -> None:
    models = ServedModels([ctx("a")])
    models.set_adapters([adapter("sql", 1, "a"), adapter("chat", 2, "a")])
    cards = [(c.id, c.parent, c.root) for c in models.cards()]
    assert cards == [("a", None, "a"), ("sql", "a", "/adapters/sql"), ("chat", "a", "/adapters/chat")]
    models.set_adapters([adapter("chat", 2, "a")])  # sql unloaded
    assert models.names() == ["a", "chat"]
    with pytest.raises(OpenAIError, match="sql"):
        models.card("sql")
    with pytest.raises(OpenAIError, match="already been loaded"):
        models.check_free("chat")
    with pytest.raises(OpenAIError, match="base model"):
        models.check_free("a")
    with pytest.raises(ValueError, match="unknown base model"):
        models.set_adapters([adapter("x", 3, "nope")])
    with pytest.raises(ValueError, match="already taken"):
        models.set_adapters([adapter("a", 3, "a")])


def test_cards_say_which_quantization_runs() -> None:
    """raytp's `quantization` field beside vLLM's, which keep their values; an adapter's is its base model's."""
    models = ServedModels([ctx("q", "int8"), ctx("f")], [adapter("sql", 1, "q")])
    cards = {c.id: c.model_dump() for c in models.cards()}
    assert {n: c["quantization"] for n, c in cards.items()} == {"q": "int8", "f": "none", "sql": "int8"}
    assert {k: v for k, v in cards["q"].items() if k != "created"} == {
        "id": "q",
        "object": "model",
        "owned_by": "raytp",
        "root": "q",
        "parent": None,
        "max_model_len": 64,
        "quantization": "int8",
    }
    assert models.card("sql").model_dump()["parent"] == "q"


def test_models_form_with_shared_defaults() -> None:
    sa = ServeArgs.from_dict(
        {
            "models": [
                {"model": "/m/a", "served_model_name": "a", "num_replicas": 2, "max_model_len": 128},
                {"model": "/m/b", "tensor_parallel_size": 2, "autoscaling_config": {"max_replicas": 3}},
            ],
            "max_model_len": 512,  # every model's default
            "api_key": "k",
        }
    )
    a, b = sa.models
    assert (a.name, a.num_replicas, a.engine.max_model_len) == ("a", 2, 128)
    assert (b.name, b.engine.tensor_parallel_size, b.engine.max_model_len) == ("/m/b", 2, 512)
    assert sa.split and sa.api_key == "k"
    with pytest.raises(ValueError, match="unique"):
        ServeArgs.from_dict({"models": [{"model": "/m/a"}, {"model": "/m/a"}]})
    with pytest.raises(ValueError, match="unknown model arguments: max_model_lenn"):
        ServeArgs.from_dict({"models": [{"model": "/m/a", "max_model_lenn": 1}]})
    with pytest.raises(ValueError, match="a list of objects"):
        ServeArgs.from_dict({"models": "/m/a"})
    with pytest.raises(ValueError, match="not one"):
        _ = sa.model


def test_lora_modules_forms_ids_and_checks() -> None:
    assert LoRAModule.parse("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    parsed = LoRAModule.parse('{"name": "sql", "path": "/a", "base_model_name": "m"}')
    assert parsed == LoRAModule("sql", "/a", "m")
    with pytest.raises(ValueError, match="name=path"):
        LoRAModule.parse("sql")
    with pytest.raises(ValueError, match="unknown LoRA module keys: rank"):
        LoRAModule.parse({"name": "x", "path": "/p", "rank": 8})
    sa = ServeArgs.from_dict(
        {
            "models": [
                {"model": "/m/a", "enable_lora": True, "lora_modules": ["x=/p/x", {"name": "y", "path": "/p/y"}]},
                {"model": "/m/b", "enable_lora": True, "lora_modules": ['{"name": "z", "path": "/p/z"}']},
            ]
        }
    )
    assert [(base, lora.lora_name, lora.lora_int_id) for base, lora in sa.lora_requests()] == [
        ("/m/a", "x", 1),
        ("/m/a", "y", 2),
        ("/m/b", "z", 3),
    ]
    with pytest.raises(ValueError, match="need enable_lora"):
        ServeArgs.from_dict({"model": "/m/a", "lora_modules": ["x=/p"]})
    with pytest.raises(ValueError, match="already a served model"):
        ServeArgs.from_dict({"model": "/m/a", "enable_lora": True, "lora_modules": ["/m/a=/p"]})
    with pytest.raises(ValueError, match="base_model_name 'other'"):
        ServeArgs.from_dict(
            {
                "model": "/m/a",
                "enable_lora": True,
                "lora_modules": [{"name": "x", "path": "/p", "base_model_name": "other"}],
            }
        )
    with pytest.raises(ValueError, match="needs a model with enable_lora"):
        ServeArgs.from_dict({"model": "/m/a", "enable_runtime_lora_updating": True})


def test_runtime_lora_updating_from_vllms_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    sa = ServeArgs.from_dict({"model": "/m/a", "enable_lora": True})
    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    assert not sa.runtime_lora_from_env().enable_runtime_lora_updating
    monkeypatch.setenv(RUNTIME_LORA_ENV, "True")
    assert sa.runtime_lora_from_env().enable_runtime_lora_updating


def test_serve_flags_and_config_file(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "/m/a",
            "--enable-lora",
            "--max-lora-rank",
            "32",
            "--lora-modules",
            "x=/p/x",
            '{"name": "y", "path": "/p/y"}',
        ]
        + ["--enable-runtime-lora-updating"]
    )
    sa = ServeArgs.from_dict(serve_args_of(args))
    assert sa.model.engine.max_lora_rank == 32 and [m.name for m in sa.model.lora_modules] == ["x", "y"]
    assert sa.enable_runtime_lora_updating
    app = {
        "name": "raytp",
        "import_path": "serve_app:build_app",
        "args": {"models": [{"model": "/m/a"}, {"model": "/m/b"}]},
    }
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [app]}))
    flags = ["serve", "--config", str(config), "--api-key", "k", "--max-model-len", "256", "--ingress-replicas", "2"]
    sa = ServeArgs.from_dict(serve_args_of(build_parser().parse_args(flags)))
    assert [m.name for m in sa.models] == ["/m/a", "/m/b"] and sa.api_key == "k" and sa.ingress_replicas == 2
    assert all(m.engine.max_model_len == 256 for m in sa.models)  # an engine flag: every model's default
    plain = tmp_path / "args.yaml"  # the args alone
    plain.write_text(json.dumps(app["args"]))
    assert (
        len(ServeArgs.from_dict(serve_args_of(build_parser().parse_args(["serve", "--config", str(plain)]))).models)
        == 2
    )
    with pytest.raises(ValueError, match="not both"):
        serve_args_of(build_parser().parse_args(["serve", "/m/c", "--config", str(config)]))


def test_registry_numbers_and_broadcasts_changes() -> None:
    async def run() -> None:
        registry = LoRARegistry(["a"], [adapter("sql", 1, "a")])
        version, table = await registry.watch(-1)  # a new replica: the table at once
        assert [x.lora.lora_name for x in table] == ["sql"]
        watcher = asyncio.create_task(registry.watch(version))
        await asyncio.sleep(0)
        assert not watcher.done()  # waits for a change
        lora_id = registry.next_id()
        assert lora_id == 2 and registry.next_id() == 3  # never reused
        new = registry.register(Adapter(LoRARequest("chat", lora_id, "/p"), "a"))
        assert (await watcher)[0] == new and [x.lora.lora_name for x in (await watcher)[1]] == ["sql", "chat"]
        with pytest.raises(OpenAIError, match="already been loaded"):
            registry.register(Adapter(LoRARequest("chat", 9, "/p"), "a"))
        with pytest.raises(OpenAIError, match="base model"):
            registry.register(Adapter(LoRARequest("a", 9, "/p"), "a"))
        assert registry.unregister("chat") == new + 1
        with pytest.raises(OpenAIError) as gone:
            registry.unregister("chat")
        assert gone.value.status == 404

    asyncio.run(run())
