"""LoRARegistry: the application's table of LoRA adapters, when they can be loaded at runtime.

Decision: one Serve deployment (one replica, no CPUs) holds which adapter names are served, for which base
model, under which lora_int_id; every ingress and model replica follows it (`LoRASync`, lora_sync.py).
Serve's balancing sends a POST /v1/load_lora_adapter to one ingress replica and its engine work to one
model replica, so the registry, not the replica that took the request, is what makes a runtime load reach
every replica of the model, including replicas started later by autoscaling (they read the table when they
start). A deployment rather than a detached actor: it lives and dies with the application. Its state is its
memory: if its replica is replaced, the table starts again from `--lora-modules` (runtime loads are lost,
as a restarted vLLM server loses them).

Ids: the startup modules are 1..n; runtime loads take the next ids, never reused, so an id always means one
checkpoint and a replica never serves a stale copy under a reused id.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from raytp.openai.errors import bad_request
from raytp.openai.lora_routes import unknown_adapter
from raytp.openai.models import Adapter

WATCH_TIMEOUT_S = 30.0  # a watcher's call returns at least this often (it calls again)


class LoRARegistry:
    def __init__(self, base_models: Sequence[str], adapters: Sequence[Adapter]) -> None:
        self._base_models = frozenset(base_models)
        self._adapters: dict[str, Adapter] = {a.lora.lora_name: a for a in adapters}
        self._next_id = max((a.lora.lora_int_id for a in adapters), default=0) + 1
        self._version = 0
        self._changed = asyncio.Event()  # set and replaced at each change: wakes every watcher

    def next_id(self) -> int:
        """A fresh lora_int_id for an adapter about to be loaded."""
        lora_int_id, self._next_id = self._next_id, self._next_id + 1
        return lora_int_id

    async def watch(self, version: int) -> tuple[int, list[Adapter]]:
        """(version, table) as soon as the table's version differs from `version` (at once for -1), or the
        unchanged table after WATCH_TIMEOUT_S."""
        if version == self._version:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), WATCH_TIMEOUT_S)
        return self._version, list(self._adapters.values())

    def register(self, adapter: Adapter) -> int:
        """Serve `adapter` (already loaded on one replica of its model); the new version. A taken name is a
        400 (two loads of one name raced: the second loses)."""
        name = adapter.lora.lora_name
        if name in self._base_models:
            raise bad_request(f"The name `{name}` is a served base model; choose another lora_name.", "lora_name")
        if name in self._adapters:
            raise bad_request(f"The LoRA adapter `{name}` has already been loaded.", "lora_name")
        self._adapters[name] = adapter
        return self._bump()

    def unregister(self, name: str) -> int:
        """Stop serving the adapter `name`; the new version. Unknown: 404."""
        if self._adapters.pop(name, None) is None:
            raise unknown_adapter(name)
        return self._bump()

    def _bump(self) -> int:
        self._version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return self._version
