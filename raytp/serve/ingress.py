"""OpenAIIngress: the Serve deployment that serves HTTP. Its replica hosts a model replica of its own
(the default) or, with `split_ingress`, reaches an `LLMServer` deployment through its handle.

Its FastAPI app is built per replica, after the constructor, from the args it was bound with
(`__serve_build_asgi_app__`, Ray Serve's late-bound ingress): the app is not a module global, and
nothing writes settings into it afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from model_exec.source import load_tokenizer, resolve_model
from raytp.openai.app import openai_app
from raytp.openai.context import ServingContext, max_token_chars
from raytp.openai.engine_client import EngineClient, ServeEngineClient
from raytp.serve.args import ServeArgs
from raytp.serve.replica import ModelReplica


@serve.ingress()
class OpenAIIngress:
    async def __init__(self, args: ServeArgs, server: DeploymentHandle | None = None) -> None:  # type: ignore[misc]
        """`server`: None hosts a model replica in this replica (the default); else (`split_ingress`) the
        handle of the LLMServer deployment."""
        self._args = args.api_key_from_env()
        source = resolve_model(args.engine.model, args.engine.revision)
        self._local: ModelReplica | None = None
        self.replica: EngineClient
        if server is None:
            self._local = await ModelReplica.start(args)
            self.replica = self._local
            tokenizer = self._local.tokenizer  # the engine's own: one copy per process
        else:
            self.replica = ServeEngineClient(server)
            tokenizer = load_tokenizer(source, args.engine.trust_remote_code)
        info = await self.replica.model_info()  # waits for a model replica: ready means servable
        self.ctx = ServingContext(
            client=self.replica,
            tokenizer=tokenizer,
            model_name=args.served_model_name or source.name,
            max_model_len=int(info["max_model_len"]),
            vocab_size=int(info["vocab_size"]),
            generation_defaults=dict(info["generation_defaults"]),
            max_token_chars=max_token_chars(tokenizer),
            chat=args.chat,
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return openai_app(self.ctx, self.replica.health, self._args.api_key, self._args.max_request_body_bytes)

    # Not routes: Serve calls these, and tests reach them through the deployment handle.
    async def check_health(self) -> None:
        """Serve's health hook. With its own model replica, a dead engine marks this replica unhealthy
        and Serve replaces it (engine and workers with it); a split ingress stays healthy on its own."""
        if self._local is not None:
            await self._local.health()

    async def get_stats(self) -> dict[str, Any]:
        """The hosted engine's counters; a split ingress hosts none (ask the LLMServer deployment)."""
        if self._local is None:
            raise RuntimeError("this ingress hosts no engine (split_ingress): ask the LLMServer deployment")
        return await self._local.get_stats()

    async def model_info(self) -> dict[str, Any]:
        return await self.replica.model_info()

    async def __del__(self) -> None:
        if self._local is not None:
            with contextlib.suppress(Exception):  # an already failed engine: nothing to release
                await self._local.shutdown()
