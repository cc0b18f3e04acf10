"""ServeLoRAAdmin: what POST /v1/load_lora_adapter and /v1/unload_lora_adapter do in a Serve application
(the routes and their checks: raytp/openai/lora_routes.py).

Load: a fresh id from the registry; the adapter loaded on one replica of its model (a bad path or a rank
over max_lora_rank fails there: a 400 naming it, and nothing is registered); then registered, which every
replica follows (lora_sync.py: the other replicas load it, ingresses route its name). Unload: unregistered;
every replica drops it when the change reaches it. Both answer once this ingress's own copy shows the change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from raytp.openai.models import Adapter
from raytp.serve.lora_sync import LoRASync
from request.lora import LoRARequest

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle


class LoRAEngine(Protocol):
    """One model's replicas, for loading an adapter into one of them: a local `ModelReplica` or
    `HandleLoRAEngine` (an LLMServer deployment)."""

    async def add_lora(self, lora: LoRARequest) -> None: ...

    async def remove_lora(self, lora_int_id: int) -> None: ...


class HandleLoRAEngine:
    def __init__(self, server: DeploymentHandle) -> None:
        self._server = server

    async def add_lora(self, lora: LoRARequest) -> None:
        await self._server.add_lora.remote(lora)

    async def remove_lora(self, lora_int_id: int) -> None:
        await self._server.remove_lora.remote(lora_int_id)


class ServeLoRAAdmin:
    def __init__(self, registry: DeploymentHandle, engines: dict[str, LoRAEngine], sync: LoRASync) -> None:
        self._registry = registry
        self._engines = engines  # by base model name
        self._sync = sync

    async def load(self, lora_name: str, lora_path: str, base_model: str) -> None:
        lora = LoRARequest(lora_name, await self._registry.next_id.remote(), lora_path)
        engine = self._engines[base_model]
        await engine.add_lora(lora)  # LoRAError (400) when the checkpoint cannot be served
        try:
            version = await self._registry.register.remote(Adapter(lora, base_model))
        except BaseException:
            await engine.remove_lora(lora.lora_int_id)  # the name was taken meanwhile
            raise
        await self._sync.wait_for(version)

    async def unload(self, lora_name: str) -> None:
        await self._sync.wait_for(await self._registry.unregister.remote(lora_name))
