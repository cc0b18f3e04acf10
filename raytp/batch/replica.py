"""One engine replica as a Ray Data actor: answers rows with the HTTP server's own handlers.

Each replica owns an `EngineController` actor (which owns its TP workers); a row is answered by its
url's row of the route table (raytp/openai/routes.py): the body parsed by that route's request model,
answered by that route's handler over an `ActorEngineClient`, so a batch body is byte-for-byte what the
HTTP route returns for the same request (ids and timestamps aside). Nothing here builds a response itself.

Decision: a row whose engine died (503 engine_unavailable) is returned with `done=False`: the driver
does not journal it and hands it out again, and this replica starts a fresh controller first.

Each engine's workers sit in a placement group named `group_prefix` + the engine's id. The group belongs to the
job, not to the controller, and Ray Data retires a replica by dropping it, which kills its controller unshut:
so the driver frees the pass's groups by that prefix once the pass ends (raytp/batch/runner.py).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from pydantic import BaseModel

from cluster.config import EngineConfig
from raytp.batch.input import BatchRow, parse_line
from raytp.batch.output import output_line
from raytp.openai.chat_settings import ChatSettings
from raytp.openai.context import ServingContext, max_token_chars
from raytp.openai.engine_client import ActorEngineClient
from raytp.openai.errors import OpenAIError, bad_request, to_openai_error
from raytp.openai.models import Adapter, ServedModels
from raytp.openai.protocol import SamplingFields
from raytp.openai.routes import ROUTES_BY_PATH, handlers
from request.lora import LoRARequest

CONTROLLER_PREFIX = "raytp-batch-engine-"
ENGINE_START_ATTEMPTS = 3


class BatchReplica:
    """Ray Data callable class: a batch of input lines -> a batch of output lines."""

    def __init__(
        self,
        engine_config: EngineConfig,
        served_model_name: str | None = None,
        chat: ChatSettings | None = None,
        loras: Sequence[LoRARequest] = (),
        group_prefix: str | None = None,
    ) -> None:
        """`loras`: adapters rows may name as `model` (the engine loads each at its first row); `group_prefix`:
        how its engines' placement groups are named (default: `raytp-…`, which the driver cannot free)."""
        from model_exec.source import load_tokenizer, resolve_model

        self._config = engine_config
        source = resolve_model(engine_config.model, engine_config.revision)
        self._tokenizer = load_tokenizer(source, engine_config.trust_remote_code)
        self._model_name = served_model_name or source.name
        self._chat = chat if chat is not None else ChatSettings()
        self._loras = list(loras)
        self._group_prefix = group_prefix
        self._loop = asyncio.new_event_loop()
        self._start_engine()

    def _start_engine(self) -> None:
        from cluster.controller import EngineController

        # An engine lost while it starts (its node lost, the actor killed) must not fail this
        # replica's construction: Ray Data treats an actor that dies in __init__ as a fatal job error.
        # A model that cannot load fails every attempt, and the last error is raised.
        for attempt in range(1, ENGINE_START_ATTEMPTS + 1):
            # Named so operators (and tests) find a batch job's engines in `ray list actors`.
            engine_id = uuid.uuid4().hex[:12]
            group = f"{self._group_prefix}{engine_id}" if self._group_prefix else None
            self.controller = EngineController.options(name=f"{CONTROLLER_PREFIX}{engine_id}").remote(
                self._config, model_name=self._model_name, group_name=group
            )
            try:
                info = ray.get(self.controller.model_info.remote())
                break
            except ray.exceptions.RayActorError:
                if attempt == ENGINE_START_ATTEMPTS:
                    raise
        self.ctx = ServingContext(
            client=ActorEngineClient(self.controller),
            tokenizer=self._tokenizer,
            model_name=self._model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            generation_defaults=dict(info.generation_defaults),
            max_token_chars=max_token_chars(self._tokenizer),
            chat=self._chat,
            pooling_task=info.pooling_task,
            quantization=info.quantization,
        )
        adapters = [Adapter(lora, self._model_name) for lora in self._loras]
        self._handlers = handlers(ServedModels([self.ctx], adapters))
        self._engine_lost = False

    async def _answer(self, line_no: int, text: str) -> tuple[str, str, dict[str, Any], bool]:
        """(custom_id, hash, output line, done) of one row."""
        row = parse_line(line_no, text)
        if not isinstance(row, BatchRow):  # the whole file was validated before the job started
            raise ValueError(f"line {line_no} is not a valid batch row: {row.message}")
        route = ROUTES_BY_PATH[row.url]  # parse_line accepts only the table's urls
        request_id = f"{route.id_prefix}-{uuid.uuid4().hex}"
        try:
            req = route.parse(row.body)
            if isinstance(req, SamplingFields) and req.stream:
                raise bad_request("stream is not supported in batch jobs.", "stream")
            resp = await self._handlers[route.path].create(req, request_id)
            assert isinstance(resp, BaseModel)  # only a streaming request answers with events
            return row.custom_id, row.body_hash, output_line(row.custom_id, request_id, 200, resp.model_dump()), True
        except Exception as e:
            err: OpenAIError = to_openai_error(e, request_id)
            lost = err.code == "engine_unavailable"
            self._engine_lost = self._engine_lost or lost
            line = output_line(row.custom_id, request_id, err.status, err.body())
            return row.custom_id, row.body_hash, line, not lost

    async def _answer_all(self, lines: list[int], texts: list[str]) -> list[tuple[str, str, dict[str, Any], bool]]:
        return list(await asyncio.gather(*(self._answer(n, t) for n, t in zip(lines, texts, strict=True))))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._engine_lost:  # the controller died on an earlier batch: a fresh engine for this one
            self._start_engine()

        results = self._loop.run_until_complete(
            self._answer_all([int(n) for n in batch["line"]], [str(t) for t in batch["text"]])
        )
        return {
            "custom_id": np.array([r[0] for r in results], dtype=object),
            "hash": np.array([r[1] for r in results], dtype=object),
            "output": np.array([json.dumps(r[2], ensure_ascii=False) for r in results], dtype=object),
            "done": np.array([r[3] for r in results], dtype=bool),
        }
