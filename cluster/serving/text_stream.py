"""One sample's text as the ingress builds it: incremental detokenization and stop strings.

The controller streams token ids only. Here each sequence is detokenized incrementally
(reusing the offline engine's IncrementalDetokenizer), checked for stop strings, and its
text released to the client. While streaming, a suffix that could still grow into a stop
string is held back, so a client never sees text that a later token turns into a stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.output_processor import IncrementalDetokenizer, find_stop_string
from cluster.protocol import SeqDelta
from scheduler.outputs import TokenLogprobs
from scheduler.sampling_params import SamplingParams


@dataclass
class SeqUpdate:
    """What one sequence released in one step; token-level fields are never held back."""

    index: int  # the sample index within the request (0 .. best_of-1)
    text: str  # newly released text
    token_ids: list[int]  # new tokens (all of them, also those whose text is still held back)
    logprobs: list[TokenLogprobs] | None  # one entry per new token, when logprobs were asked for
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


@dataclass
class SequenceText:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    prompt_token_ids: list[int]
    text: str = ""  # everything decoded so far (trimmed at a stop string)
    released: int = 0  # text[:released] has gone to the client
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stopped_here: bool = False  # finished by a stop string here; the controller does not know yet

    def __post_init__(self) -> None:
        self._state = self.detok.start(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, delta: SeqDelta) -> SeqUpdate | None:
        """Fold one controller delta in; None when nothing new is visible (or already finished here)."""
        if self.finished:
            return None  # stopped by a string here: later tokens the controller made are dropped
        params = self.params
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            self.logprobs.extend(delta.new_logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        searched = len(self._state.text)
        self.detok.feed(self._state, delta.new_token_ids, params.skip_special_tokens)
        self.text = self._state.text
        hit = None
        if params.stop and len(self.token_ids) >= params.min_tokens:
            hit = find_stop_string(self.text, params.stop, searched)
        if hit is not None:
            idx, stop = hit
            self.text = self.text[: idx + len(stop)] if params.include_stop_str_in_output else self.text[:idx]
            self.finish_reason, self.stop_reason, self.stopped_here = "stop", stop, True
        elif delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        end = len(self.text)
        if not self.finished and params.stop and not params.include_stop_str_in_output:
            # (With include_stop_str_in_output a partial stop string is released anyway: it stays.)
            end -= stop_prefix_len(self.text, params.stop)
        new_text = self.text[self.released : max(end, self.released)]
        self.released = max(end, self.released)
        if not new_text and not delta.new_token_ids and not self.finished:
            return None
        return SeqUpdate(
            index=self.index,
            text=new_text,
            token_ids=list(delta.new_token_ids),
            logprobs=list(delta.new_logprobs) if delta.new_logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
