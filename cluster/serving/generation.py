"""One engine request seen from the ingress: deltas in, per-sequence text updates out.

A `Generation` opens a stream to the `LLMServer` deployment (which relays its controller's
RequestDeltas), folds every delta into per-sequence `SequenceText`s, and ends the request at
the controller as soon as the client no longer needs it: when every sequence finished here
(stop strings), when the client disconnects, or on any error. Ending is a cancellation of the
Serve stream; the server replica turns it into an abort at its controller, freeing the blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from ray.serve.handle import DeploymentResponseGenerator

from cluster.output_processor import IncrementalDetokenizer
from cluster.protocol import RequestDelta
from cluster.serving.errors import error_for_delta
from cluster.serving.text_stream import SequenceText, SeqUpdate
from scheduler.outputs import TokenLogprobs
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle


class Generation:
    def __init__(
        self,
        server: DeploymentHandle,  # the LLMServer handle with stream=True
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detok: IncrementalDetokenizer,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = [SequenceText(i, params, detok, prompt_token_ids) for i in range(params.actual_best_of)]
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self._server = server
        self._stream: DeploymentResponseGenerator | None = None
        self._first: RequestDelta | None = None
        self._done = False  # the controller has nothing more to send (finished, or cancelled by us)

    async def start(self) -> None:
        """Submit, and wait for the first delta: refusals (400/503) surface before any HTTP headers."""
        stream = self._server.generate.remote(self.request_id, self.prompt_token_ids, self.params)
        assert isinstance(stream, DeploymentResponseGenerator)
        self._stream = stream
        try:
            self._first = await stream.__anext__()
        except StopAsyncIteration:
            self._done = True
        except BaseException:
            self.close()
            raise
        if (
            self._first is not None
            and self._first.error is not None
            and not any(s.new_token_ids for s in self._first.seqs)
        ):
            self.close()
            raise error_for_delta(self._first.error)

    async def updates(self) -> AsyncIterator[list[SeqUpdate]]:
        """Per controller step, the updates of the sequences that changed. Ends when all finished."""
        stream = self._stream
        assert stream is not None, "start() first"
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield self._apply(first)
            while not self._done and not self.finished:
                try:
                    delta = await stream.__anext__()
                except StopAsyncIteration:
                    self._done = True
                    break
                yield self._apply(delta)
        finally:
            self.close()

    def _apply(self, delta: RequestDelta) -> list[SeqUpdate]:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        updates = [u for s in delta.seqs if (u := self.seqs[s.index].apply(s)) is not None]
        if delta.finished:
            self._done = True
            # A request that ends without its sequences saying why (an engine failure) ends them all.
            for seq in self.seqs:
                if not seq.finished:
                    seq.finish_reason = "abort"
                    updates.append(SeqUpdate(seq.index, "", [], None, "abort"))
        if delta.error is not None:
            raise error_for_delta(delta.error)
        return updates

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def close(self) -> None:
        """Idempotent. Cancels the Serve stream unless the controller already finished the request."""
        if self._stream is not None and not self._done:
            self._done = True
            self._stream.cancel()

    def best(self, n: int) -> list[SequenceText]:
        """The n sequences to return: all of them, or with best_of > n the n most likely ones."""
        if len(self.seqs) <= n:
            return list(self.seqs)
        return sorted(self.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]


async def run_to_end(gen: Generation) -> None:
    async for _ in gen.updates():
        pass


async def start_all(gens: Sequence[Generation]) -> None:
    """Start every generation; if any is refused, end the others and raise the first refusal."""
    results = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for g in gens:
            g.close()
        raise errors[0]


async def merge_updates(gens: Sequence[Generation]) -> AsyncIterator[tuple[int, list[SeqUpdate]]]:
    """(generation index, updates) from several generations as they arrive (one per prompt)."""
    if len(gens) == 1:
        async for ups in gens[0].updates():
            yield 0, ups
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    _END = object()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for ups in g.updates():
                await queue.put((i, ups))
            await queue.put((i, _END))
        except Exception as e:  # handed to the consumer, which re-raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(gens)
        while live:
            i, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            g.close()
