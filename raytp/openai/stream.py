"""One engine request seen from a handler: the engine's `RequestDelta` stream, and how to end it.

The deltas come through an `EngineClient` (engine_client.py: in-process, Serve handle or Ray actor);
they already carry text, stop-string trimming, logprobs and finish reasons (the engine's one output
road), so nothing here decodes or decides anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cluster.outputs import PromptInfo, RequestDelta, RequestOutput, RequestOutputBuilder
from raytp.openai.engine_client import EngineClient, EngineRequest
from raytp.openai.errors import request_failed


class RequestStream:
    """Deltas of one request; `start` surfaces a refusal (400/503) before any HTTP header is sent."""

    def __init__(self, client: EngineClient, request: EngineRequest):
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.params = request.params
        self._it = client.generate(request)
        self._first: RequestDelta | None = None
        self.prompt: PromptInfo | None = None  # from the first delta (prompt logprobs, cached tokens)
        self._done = False

    async def start(self) -> None:
        try:
            self._first = await anext(self._it)
        except BaseException:
            await self.close()
            raise
        self.prompt = self._first.prompt
        self._check(self._first)

    def _check(self, delta: RequestDelta) -> None:
        if delta.finished:
            self._done = True
            if delta.error is not None:
                raise request_failed(delta.error, self.request_id)

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """Every delta, in order, the first included; raises when the engine could not finish the request."""
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield first
            while not self._done:
                try:
                    delta = await anext(self._it)
                except StopAsyncIteration:
                    self._done = True
                    return
                self._check(delta)
                yield delta
        finally:
            await self.close()

    async def collect(self) -> RequestOutput:
        builder = RequestOutputBuilder(self.request_id)
        async for delta in self.deltas():
            builder.add(delta)
        return builder.build()

    async def close(self) -> None:
        """Idempotent; aborts the request at the engine unless it already finished."""
        self._done = True
        await self._it.aclose()  # type: ignore[attr-defined]  # an async generator


async def start_all(streams: Sequence[RequestStream]) -> None:
    """Start every stream; if any is refused, end the others and raise the first refusal."""
    results = await asyncio.gather(*(s.start() for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
        raise errors[0]


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(stream index, delta) from several streams as they arrive (one stream per prompt)."""
    if len(streams) == 1:
        async for delta in streams[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for delta in s.deltas():
                await queue.put((i, delta))
            await queue.put((i, end))
        except Exception as e:  # handed to the consumer, which re-raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, item = await queue.get()
            if item is end:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a cancelled pump closes (aborts) its stream
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
