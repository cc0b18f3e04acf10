"""One model replica in a Serve replica: `ModelReplica` (the engine loop, admission control, the LoRA
adapters resident in it) and `LLMServer`, the deployment that hosts one apart from the ingress
(`split_ingress`, and one deployment per model when an application serves several).

Decision: the engine loop lives in a Serve replica, not in an actor of its own, and by default in the
replica that serves HTTP (`OpenAIIngress`). A streamed token then crosses no Ray message at all between
the engine and the HTTP response: an asyncio queue hands it to the route's SSE stream (README, "Serving
hops"). Either way the replica's lifetime is the engine's: a replica that Serve stops or replaces takes
its engine and TP workers with it, so `num_replicas` / autoscaling scale whole model replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ray import serve

from cluster.config import EngineConfig
from cluster.loop_records import LoopStats, ModelInfo
from cluster.outputs import RequestDelta
from raytp.openai.engine_client import EngineRequest
from raytp.openai.errors import EngineOverloadedError
from raytp.serve.args import ModelArgs
from raytp.serve.lora_sync import LoRASync
from request.lora import LoRAError, LoRARequest

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from cluster.controller import EngineLoop

logger = logging.getLogger(__name__)
UNLOAD_RETRY_S = 0.5  # an unloaded adapter still in use is retried this often until its requests finish


def served_executor_backend(config: EngineConfig) -> Literal["ray", "inprocess"]:
    """Where a model replica's model runs: `distributed_executor_backend` as given, else in TP worker actors.
    One answer for the replica's engine (`start_engine`) and its deployment's resources (raytp/serve/app.py)."""
    return config.distributed_executor_backend or "ray"


async def start_engine(config: EngineConfig, served_model_name: str | None) -> tuple[EngineLoop, ModelInfo]:
    """Load the model in this Serve replica: (its engine loop, model_info). Loading blocks (it waits on the
    workers), so it runs off the event loop; a replica that awaits this in its async __init__ does not report
    ready before it is done. The Serve replica id labels this engine's metrics (`replica`), as Serve's own
    series name replicas. A model run in-process computes on as many torch threads as the replica reserved
    CPUs (what a TP rank's bundle would have: `engine_deployment`)."""
    from cluster.controller import EngineLoop  # imported where a model replica starts, not by every importer
    from cluster.placement import cpus_per_worker

    backend = served_executor_backend(config)
    config = dataclasses.replace(config, distributed_executor_backend=backend)
    threads = max(1, int(cpus_per_worker())) if backend == "inprocess" else None
    replica = serve.get_replica_context().replica_id.unique_id
    engine = await asyncio.to_thread(EngineLoop, config, replica, served_model_name, num_threads=threads)
    info = await engine.model_info()
    logger.info("model replica ready: %s", info)
    return engine, info


class ModelReplica:
    """One model replica: the engine's step loop (`EngineLoop`: scheduler, KV blocks, output processing)
    in this process, its TP worker actors in their placement group, and admission control. The in-process
    transport of `EngineClient` (raytp/openai/engine_client.py).

    The step loop shares the replica's event loop with the request streams (and, in Serve's
    high-throughput mode, with Serve's own request handling); only schedule/update run there, a few ms
    per step, while the forward pass waits in the loop's step thread. A dead engine (a worker died, a step
    failed) is observed by `health`, and Serve replaces the replica.

    LoRA adapters: the ones served from the start (`--lora-modules`) are loaded before the replica is
    ready; any other a request names (loaded at runtime through another replica) the engine loads on first
    use, and `sync_loras` keeps the resident set equal to the application's registry (lora_sync.py).
    """

    def __init__(self, engine: EngineLoop, info: ModelInfo, max_waiting_requests: int | None) -> None:
        self._engine = engine
        self._info = info
        self._max_waiting = max_waiting_requests
        self._num_waiting = 0  # requests accepted here that have not produced a delta yet
        self._unloads: set[asyncio.Task[None]] = set()  # adapters waiting for their requests to finish

    @classmethod
    async def start(cls, model: ModelArgs, loras: Sequence[LoRARequest] = ()) -> ModelReplica:
        replica = cls(*await start_engine(model.engine, model.served_model_name), model.max_waiting_requests)
        for lora in loras:
            await replica.add_lora(lora)
        return replica

    @property
    def tokenizer(self) -> Any:
        return self._engine.engine.tokenizer

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """Stream the engine's deltas. Closing this stream early (client gone) aborts the request."""
        self._admit()
        waiting = True  # counted in self._num_waiting until its first delta arrives
        try:
            # aclosing: a stream closed early closes the engine's generator at once, which aborts the
            # request and frees its blocks (not whenever the garbage collector finalizes it).
            r = request
            async with contextlib.aclosing(
                self._engine.generate(r.request_id, r.prompt_token_ids, r.params, r.lora_request)
            ) as deltas:
                async for delta in deltas:
                    if waiting:
                        waiting = False
                        self._num_waiting -= 1
                    yield delta
        finally:
            if waiting:
                self._num_waiting -= 1

    def _admit(self) -> None:
        """Refuse (503) once max_waiting_requests requests wait for their first token here.

        Decision: "waiting" is counted in this replica (accepted, no output yet), not read from the
        scheduler's queue: the check is then exact under concurrent arrivals; the two differ only by
        requests preempted back into the scheduler's queue.
        """
        if self._max_waiting is not None and self._num_waiting >= self._max_waiting:
            raise EngineOverloadedError(
                f"The server is overloaded: {self._num_waiting} requests are waiting "
                f"(max_waiting_requests={self._max_waiting}); retry later."
            )
        self._num_waiting += 1

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load `lora` into this engine (a no-op when it is loaded; LoRAError when it cannot be served, and
        nothing changes then)."""
        await self._engine.add_lora(lora)

    async def remove_lora(self, lora_int_id: int) -> None:
        await self._engine.remove_lora(lora_int_id)

    async def sync_loras(self, loras: Sequence[LoRARequest]) -> None:
        """Make the resident adapters the application's: unload the ones no longer served, load the new ones.
        An adapter still used by requests is unloaded once they finish (`_unload_when_idle`); one that cannot
        load here is logged, and its requests get the engine's 400 when they name it."""
        wanted = {lora.lora_int_id: lora for lora in loras}
        for lora in await self._engine.list_loras():
            if lora.lora_int_id not in wanted:
                await self._unload_when_idle(lora.lora_int_id)
        for lora in wanted.values():
            try:
                await self._engine.add_lora(lora)
            except Exception as e:
                logger.warning("LoRA adapter %s could not be loaded into this replica: %s", lora.lora_name, e)

    async def _unload_when_idle(self, lora_int_id: int) -> None:
        try:
            await self._engine.remove_lora(lora_int_id)
        except LoRAError:  # in use: the engine refuses to pull weights from under running requests
            task = asyncio.get_running_loop().create_task(self._retry_unload(lora_int_id))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _retry_unload(self, lora_int_id: int) -> None:
        while True:
            await asyncio.sleep(UNLOAD_RETRY_S)
            try:
                await self._engine.remove_lora(lora_int_id)
                return
            except LoRAError:
                continue
            except Exception as e:  # a dead engine: the replica is being replaced, with its adapters
                logger.warning("unloading LoRA adapter %d failed: %s", lora_int_id, e)
                return

    async def model_info(self) -> ModelInfo:
        return self._info

    async def get_stats(self) -> LoopStats:
        """The engine's counters (queues, KV blocks). Serve calls reach it through the deployment that
        hosts this replica; no transport forwards it."""
        return await self._engine.get_stats()

    async def health(self) -> None:
        """Raises EngineDeadError when the engine is dead (the ingress answers 503)."""
        await self._engine.check_health()

    async def shutdown(self) -> None:
        await self._engine.shutdown()


class LLMServer(ModelReplica):
    """The `LLMServer` deployment of `split_ingress` apps, one per model of a multi-model app: a
    `ModelReplica` as a Serve replica of its own, reached by the ingress through a deployment handle (one
    Ray message per streamed token). `registry`: the application's LoRARegistry, when adapters can be
    loaded at runtime: this replica follows it (including a replica started later by autoscaling)."""

    # Serve (like Ray actors) runs an async __init__ to completion before the replica takes requests.
    async def __init__(  # type: ignore[misc]
        self, model: ModelArgs, loras: Sequence[LoRARequest] = (), registry: DeploymentHandle | None = None
    ) -> None:
        engine, info = await start_engine(model.engine, model.served_model_name)
        super().__init__(engine, info, model.max_waiting_requests)
        for lora in loras:
            await self.add_lora(lora)
        self._sync: LoRASync | None = None
        if registry is not None:
            name = model.name
            self._sync = LoRASync(
                registry, lambda table: self.sync_loras([a.lora for a in table if a.base_model == name])
            )
            await self._sync.start()

    async def check_health(self) -> None:
        # Serve's health hook: raising marks this replica unhealthy, and Serve replaces it
        # (and with it the engine and its workers) with a fresh one.
        await self.health()

    async def __del__(self) -> None:
        if getattr(self, "_sync", None) is not None:
            await self._sync.stop()  # type: ignore[union-attr]
        with contextlib.suppress(Exception):  # a half-built or already failed engine: nothing to release
            await self.shutdown()
