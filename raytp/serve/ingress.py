"""OpenAIIngress: the Serve deployment that serves HTTP. With one model its replica hosts a model replica
of its own (the default) or, with `split_ingress`, reaches an `LLMServer` deployment through its handle;
with several models it reaches each model's own LLMServer deployment, and a request's `model` picks which
(`ServedModels`, raytp/openai/models.py).

Its FastAPI app is built per replica, after the constructor, from the args it was bound with
(`__serve_build_asgi_app__`, Ray Serve's late-bound ingress): the app is not a module global, and
nothing writes settings into it afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.loop_records import LoopStats, ModelInfo
from model_exec.source import load_tokenizer, resolve_model
from raytp.openai.app import openai_app
from raytp.openai.context import ServingContext, max_token_chars
from raytp.openai.engine_client import EngineClient, ServeEngineClient
from raytp.openai.models import Adapter, ServedModels
from raytp.serve.args import ModelArgs, ServeArgs
from raytp.serve.lora_admin import HandleLoRAEngine, LoRAEngine, ServeLoRAAdmin
from raytp.serve.lora_sync import LoRASync
from raytp.serve.replica import ModelReplica


@serve.ingress()
class OpenAIIngress:
    async def __init__(  # type: ignore[misc]
        self,
        args: ServeArgs,
        servers: dict[str, DeploymentHandle] | None = None,
        registry: DeploymentHandle | None = None,
    ) -> None:
        """`servers`: None hosts the only model's replica in this replica (the default); else each model's
        LLMServer deployment handle, by served name. `registry`: the LoRARegistry deployment, when adapters
        can be loaded at runtime."""
        self._args = args.api_key_from_env()
        self._local: ModelReplica | None = None
        startup = _startup_adapters(args)
        clients: dict[str, EngineClient] = {}
        contexts: list[ServingContext] = []
        if servers is None:
            model = args.model
            self._local = await ModelReplica.start(model, [a.lora for a in startup])
            clients[model.name] = self._local
            contexts.append(await _context(model, self._local, self._local.tokenizer))
        else:
            for model in args.models:
                client = clients[model.name] = ServeEngineClient(servers[model.name])
                source = resolve_model(model.engine.model, model.engine.revision)
                tokenizer = load_tokenizer(source, model.engine.trust_remote_code)
                contexts.append(await _context(model, client, tokenizer))
        self._clients = clients
        self.models = ServedModels(contexts, startup)
        self._sync: LoRASync | None = None
        self._lora_admin: ServeLoRAAdmin | None = None
        if registry is not None:
            self._sync = LoRASync(registry, self._on_lora_table)
            await self._sync.start()
            engines: dict[str, LoRAEngine] = {}
            for model in args.models:
                if not model.engine.enable_lora:
                    continue
                if self._local is not None:
                    engines[model.name] = self._local
                elif servers is not None:
                    engines[model.name] = HandleLoRAEngine(servers[model.name])
            self._lora_admin = ServeLoRAAdmin(registry, engines, self._sync)

    async def _on_lora_table(self, table: list[Adapter]) -> None:
        self.models.set_adapters(table)
        if self._local is not None:  # the engine hosted here follows the table too
            await self._local.sync_loras([a.lora for a in table])

    async def health(self) -> None:
        """Raises when any served model's engine cannot serve."""
        await asyncio.gather(*(c.health() for c in self._clients.values()))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return openai_app(
            self.models, self.health, self._args.api_key, self._args.max_request_body_bytes, self._lora_admin
        )

    # Not routes: Serve calls these, and tests reach them through the deployment handle.
    async def check_health(self) -> None:
        """Serve's health hook. With its own model replica, a dead engine marks this replica unhealthy
        and Serve replaces it (engine and workers with it); a split ingress stays healthy on its own."""
        if self._local is not None:
            await self._local.health()

    async def get_stats(self) -> LoopStats:
        """The hosted engine's counters; a split ingress hosts none (ask the LLMServer deployment)."""
        if self._local is None:
            raise RuntimeError("this ingress hosts no engine (split_ingress): ask the LLMServer deployment")
        return await self._local.get_stats()

    async def served_names(self) -> tuple[str, list[str]]:
        """(this Serve replica's id, the names it routes: models, then adapters), for operators and tests
        checking that a runtime LoRA change reached every ingress replica."""
        return serve.get_replica_context().replica_id.unique_id, self.models.names()

    async def model_info(self, model: str | None = None) -> ModelInfo:
        """The engine's model_info of `model` (default: the only model)."""
        return await self._clients[model or self._args.model.name].model_info()

    async def __del__(self) -> None:
        if self._sync is not None:
            await self._sync.stop()
        if self._local is not None:
            with contextlib.suppress(Exception):  # an already failed engine: nothing to release
                await self._local.shutdown()


def _startup_adapters(args: ServeArgs) -> list[Adapter]:
    return [Adapter(lora, base) for base, lora in args.lora_requests()]


async def _context(model: ModelArgs, client: EngineClient, tokenizer: Any) -> ServingContext:
    info = await client.model_info()  # waits for a model replica: ready means servable
    return ServingContext(
        client=client,
        tokenizer=tokenizer,
        model_name=model.name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        generation_defaults=dict(info.generation_defaults),
        max_token_chars=max_token_chars(tokenizer),
        chat=model.chat,
        enable_lora=model.engine.enable_lora,
        pooling_task=info.pooling_task,
        quantization=info.quantization,
    )
