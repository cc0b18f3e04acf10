"""`LLMServer`: the Serve deployment whose replicas are the model replicas.

Each replica creates and owns one `EngineController` actor (which owns the TP workers, in
their placement group). Ownership is the lifetime: a replica that Serve stops or replaces
takes its controller and workers with it, so `num_replicas` / autoscaling scale whole model
replicas and Serve's router balances requests across them.

Decision: the controller is a separate actor rather than the engine living inside the
replica, so the step loop never competes with Serve's request handling for the replica's
event loop, and a dead engine is observed (check_health) rather than crashing the replica.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from cluster.config import EngineConfig
from cluster.engine import EngineDeadError
from cluster.protocol import RequestDelta
from cluster.serving.errors import EngineOverloadedError
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Default concurrency of one replica: the engine queues and batches, so Serve should not
# hold requests back below what the scheduler can take (max_num_seqs defaults to 256).
DEFAULT_MAX_ONGOING_REQUESTS = 1024


class LLMServer:
    # Serve (like Ray actors) runs an async __init__ to completion before the replica takes requests.
    async def __init__(  # type: ignore[misc]
        self, engine_config: EngineConfig, max_waiting_requests: int | None = None
    ) -> None:
        from cluster.controller import EngineController

        ctx = serve.get_replica_context()
        # Named after the replica so operators (and tests) can find it in `ray list actors`.
        name = f"EngineController:{ctx.app_name}:{ctx.replica_id.unique_id}"
        self._controller = EngineController.options(name=name).remote(engine_config)  # type: ignore[attr-defined]
        self._max_waiting = max_waiting_requests
        self._num_waiting = 0  # requests accepted here that have not produced a delta yet
        # Waiting here keeps the replica from reporting ready before the model is loaded.
        self._info: dict[str, Any] = await self._controller.model_info.remote()
        logger.info("model replica ready: %s", self._info)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestDelta]:
        """Relay the controller's deltas. Cancelling this stream (client gone) aborts the request."""
        self._admit()
        finished = False
        waiting = True  # counted in self._num_waiting until its first delta arrives
        try:
            stream = self._controller.generate.options(num_returns="streaming").remote(
                request_id, prompt_token_ids, params
            )
            async for ref in stream:
                delta: RequestDelta = await ref
                if waiting:
                    waiting = False
                    self._num_waiting -= 1
                finished = delta.finished
                yield delta
        except ray.exceptions.RayActorError as e:
            finished = True  # nothing left to abort
            raise EngineDeadError(f"the engine controller died: {e}") from None
        finally:
            if waiting:
                self._num_waiting -= 1
            if not finished:
                # Fire and forget: this task may be cancelled, and the abort must not wait on it.
                self._controller.abort.remote(request_id)

    def _admit(self) -> None:
        """Refuse (503) once max_waiting_requests requests wait for their first token here.

        Decision: "waiting" is counted in this replica (accepted, no output yet), not read from
        the controller's queue: the check is then exact under concurrent arrivals and costs no
        round trip; the two differ only by requests preempted back into the controller's queue.
        """
        if self._max_waiting is not None and self._num_waiting >= self._max_waiting:
            raise EngineOverloadedError(
                f"the server is overloaded: {self._num_waiting} requests are waiting "
                f"(max_waiting_requests={self._max_waiting}); retry later."
            )
        self._num_waiting += 1

    async def model_info(self) -> dict[str, Any]:
        return self._info

    async def get_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = await self._controller.get_stats.remote()
        return stats

    async def health(self) -> None:
        """Raises when the engine is dead (the ingress answers 503)."""
        try:
            await self._controller.check_health.remote()
        except ray.exceptions.RayActorError as e:
            raise EngineDeadError(f"the engine controller died: {e}") from None

    async def check_health(self) -> None:
        # Serve's health hook: raising marks this replica unhealthy, and Serve replaces it
        # (and with it the controller and workers) with a fresh one.
        await self.health()

    async def __del__(self) -> None:
        with contextlib.suppress(Exception):  # already dead: nothing to release
            await self._controller.shutdown.remote()


def server_deployment(
    num_replicas: int | None,
    autoscaling_config: dict[str, Any] | None,
    max_ongoing_requests: int,
    health_check_period_s: float | None,
) -> serve.Deployment:
    """The LLMServer deployment with its scaling options (explicit options only)."""
    options: dict[str, Any] = {
        "name": "LLMServer",
        "max_ongoing_requests": max_ongoing_requests,
        # The replica only relays; the compute is reserved by the controller and its workers.
        "ray_actor_options": {"num_cpus": 0},
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas if num_replicas is not None else 1
    if health_check_period_s is not None:
        options["health_check_period_s"] = health_check_period_s
    return serve.deployment(**options)(LLMServer)
