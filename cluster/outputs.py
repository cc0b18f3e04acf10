"""What the engine streams (`RequestDelta`) and what the offline API returns (vLLM's `RequestOutput`).

One road: the engine emits, per step, one `RequestDelta` for every request that changed — new
text, new token ids, new logprobs per sample, finish reasons — and nothing else. Streaming
consumers (the HTTP service) forward deltas; everyone who wants the whole result (`LLM.generate`,
non-streaming HTTP, batch jobs) folds them with `RequestOutputBuilder`, the one place a
`RequestOutput` is assembled. Deltas carry only what is new, so a stream costs O(tokens) in all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None  # the token's text, special tokens kept


# token id -> Logprob, one dict per position (vLLM's SampleLogprobs / PromptLogprobs entries): the top-k
# tokens asked for plus the sampled (or, for prompts, the actual) token.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of a request's life, in the final delta."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


# ----------------------------------------------------------------------------- the stream


@dataclass(slots=True)  # one per changed sample per step (slots: cheaper to build, to pickle, to keep)
class SampleDelta:
    """What one sample (one of the request's n outputs) gained in one step."""

    index: int  # which of the request's n outputs (0 .. n-1)
    text: str  # newly released text (a possible start of a stop string is held back until decided)
    token_ids: list[int]  # new token ids, up to and including a stop token or the token completing a stop string
    logprobs: list[PositionLogprobs] | None  # one entry per new token, when logprobs were asked for
    cumulative_logprob: float | None  # running total over all tokens so far, when logprobs were asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" in the sample's last delta
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class PromptInfo:
    """The prompt side of a request, sent once: in the request's first delta."""

    prompt: str | None  # the text, when the request came as text
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None] | None  # per prompt position (the first is None), when asked for
    num_cached_tokens: int  # leading prompt tokens whose KV came from the prefix cache


@dataclass(slots=True)  # one per changed request per step
class RequestDelta:
    request_id: str
    samples: list[SampleDelta] = field(default_factory=list)  # only samples that changed
    prompt: PromptInfo | None = None  # in the first delta of the request only
    finished: bool = False  # the request's last delta
    metrics: RequestMetrics | None = None  # in the last delta only
    # In the last delta, when the server could not finish the request (engine failure, shutdown, KV capacity).
    # Requests a user got wrong never get here: they are refused with a RequestError when added.
    error: str | None = None
    # A pooling request's result, in its last delta (float32 numpy array: an embedding, or a cross-encoder's
    # scores per label); None for generation and for a pooling request that failed (`error`)
    pooled: Any = None


# ----------------------------------------------------------------------------- the whole result


@dataclass
class CompletionOutput:
    index: int  # which of the request's n outputs
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the server could not finish the request (see RequestDelta.error)
    num_cached_tokens: int = 0


@dataclass
class _SampleParts:
    """One sample's pieces so far; joined once, when the output is taken (no quadratic string growth)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestOutputBuilder:
    """Folds one request's deltas, in order, into its `RequestOutput`."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt: PromptInfo | None = None
        self.samples: dict[int, _SampleParts] = {}
        self.finished = False
        self.metrics: RequestMetrics | None = None
        self.error: str | None = None

    def add(self, delta: RequestDelta) -> None:
        if delta.prompt is not None:
            self.prompt = delta.prompt
        for s in delta.samples:
            parts = self.samples.setdefault(s.index, _SampleParts())
            parts.text.append(s.text)
            parts.token_ids.extend(s.token_ids)
            if s.logprobs is not None:
                if parts.logprobs is None:
                    parts.logprobs = []
                parts.logprobs.extend(s.logprobs)
            parts.cumulative_logprob = s.cumulative_logprob
            if s.finish_reason is not None:
                parts.finish_reason, parts.stop_reason = s.finish_reason, s.stop_reason
        if delta.finished:
            self.finished, self.metrics, self.error = True, delta.metrics, delta.error

    def build(self) -> RequestOutput:
        prompt = self.prompt
        outputs = [
            CompletionOutput(
                index=i,
                text="".join(p.text),
                token_ids=list(p.token_ids),
                cumulative_logprob=p.cumulative_logprob,
                logprobs=list(p.logprobs) if p.logprobs is not None else None,
                finish_reason=p.finish_reason,
                stop_reason=p.stop_reason,
            )
            for i, p in sorted(self.samples.items())
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=prompt.prompt if prompt is not None else None,
            prompt_token_ids=list(prompt.token_ids) if prompt is not None else [],
            prompt_logprobs=prompt.logprobs if prompt is not None else None,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics,
            error=self.error,
            num_cached_tokens=prompt.num_cached_tokens if prompt is not None else 0,
        )
