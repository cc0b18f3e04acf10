"""What the EngineController streams to its callers (the Serve ingress, the offline API over Ray).

Per request, the controller yields one `RequestDelta` per engine step in which the request
changed. Deltas carry only what is new, so a long generation costs O(tokens) traffic in
total, not O(tokens^2). Token ids only: detokenization and stop strings belong to the
caller (the ingress owns the tokenizer), which aborts the request when a stop string hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.outputs import TokenLogprobs


@dataclass
class SeqDelta:
    index: int  # the sequence's sample index within the request (0 .. best_of-1)
    new_token_ids: list[int]  # tokens generated since the previous delta for this sequence
    new_logprobs: list[TokenLogprobs] | None  # one entry per new token, when SamplingParams.logprobs is set
    cumulative_logprob: float  # raw-logprob sum over all tokens so far (ranks best_of samples)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once the sequence ended
    stop_reason: int | str | None = None  # the stop token id that ended it, if any


@dataclass
class RequestDelta:
    request_id: str
    seqs: list[SeqDelta] = field(default_factory=list)  # only sequences that changed
    prompt_token_ids: list[int] | None = None  # in the first delta only
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the first delta, when asked for
    finished: bool = False  # the last delta of the request
    error: str | None = None  # set when the request could not be served (too long for the pool, worker died)
