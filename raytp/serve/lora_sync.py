"""LoRASync: a replica's copy of the application's LoRA table, kept in step with the LoRARegistry.

Each ingress replica and each LLMServer replica runs one: a task that long-polls the registry's `watch`
and hands every new table to its owner (the ingress: the names it routes; a model replica: the adapters
resident in its engine). A change reaches every replica within one Ray round trip, and no request pays a
registry call. `wait_for(version)` lets the replica that took a load or unload answer only once its own
copy shows it, so the client's next request through that replica already sees the change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from raytp.openai.models import Adapter

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger(__name__)
RETRY_S = 1.0  # after a failed watch (the registry's replica being replaced)

OnChange = Callable[[list[Adapter]], Awaitable[None] | None]


class LoRASync:
    def __init__(self, registry: DeploymentHandle, on_change: OnChange) -> None:
        self._registry = registry
        self._on_change = on_change
        self._version = -1
        self._applied = asyncio.Condition()
        self._task: asyncio.Task[Any] | None = None

    async def start(self) -> None:
        """Apply the current table, then follow changes in the background."""
        await self._poll()
        self._task = asyncio.create_task(self._follow())

    async def wait_for(self, version: int) -> None:
        async with self._applied:
            await self._applied.wait_for(lambda: self._version >= version)

    async def _poll(self) -> None:
        version, table = await self._registry.watch.remote(self._version)
        if version != self._version:
            result = self._on_change(table)
            if result is not None:
                await result
        async with self._applied:
            self._version = version
            self._applied.notify_all()

    async def _follow(self) -> None:
        while True:
            try:
                await self._poll()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the registry's replica being replaced, or the owner failing to apply
                logger.warning("LoRA table not followed (%s); retrying in %.0f s", e, RETRY_S)
                await asyncio.sleep(RETRY_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
