"""Detokenization, stop strings and RequestOutput assembly.

This runs where the tokenizer lives (the engine for the offline API, the Serve ingress
for HTTP), after the scheduler has appended a step's tokens. Text is decoded
incrementally: each step decodes only a short window of ids around the new tokens, so
the cost per step does not grow with the output length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from scheduler.outputs import TokenLogprobs
from scheduler.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from scheduler.scheduler import Scheduler

_PROMPT_CONTEXT = 6  # prompt tokens decoded with the first output tokens, so leading spaces come out right


@dataclass
class _DetokState:
    ids: list[int]  # a window of prompt context + all output ids
    prefix_offset: int  # ids[prefix_offset:read_offset] is already reflected in text
    read_offset: int
    text: str = ""
    num_output_seen: int = 0


def find_stop_string(text: str, stops: tuple[str, ...], num_searched: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` as (index, stop), or None.

    `text[:num_searched]` was searched before (and held no stop string), so only matches that
    end after it are possible: the search starts `len(longest stop) - 1` characters before it.
    Shared by the offline OutputProcessor and the Serve ingress.
    """
    if not stops:
        return None
    search_from = max(0, num_searched - max(len(s) for s in stops) + 1)
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, search_from)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def start(self, prompt_token_ids: list[int]) -> _DetokState:
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        return _DetokState(ids=list(context), prefix_offset=0, read_offset=len(context))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def feed(self, state: _DetokState, new_ids: list[int], skip_special_tokens: bool) -> str:
        """Append ids, return the newly readable text (possibly "" while a multi-byte char is incomplete)."""
        state.ids.extend(new_ids)
        prefix_text = self.decode(state.ids[state.prefix_offset : state.read_offset], skip_special_tokens)
        full_text = self.decode(state.ids[state.prefix_offset :], skip_special_tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.ids)
            state.text += delta
            return delta
        return ""


class OutputProcessor:
    """Turns scheduler state into RequestOutputs; finishes sequences that hit a stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._states: dict[int, _DetokState] = {}

    def process(self, groups: list[SequenceGroup], scheduler: Scheduler) -> None:
        """Detokenize the new tokens of every live sequence and apply stop strings."""
        if self.detok is None:
            return
        for group in groups:
            params = group.sampling_params
            for seq in group.seqs:
                state = self._state(seq)
                new_ids = seq.output_token_ids[state.num_output_seen :]
                if not new_ids:
                    continue
                state.num_output_seen = len(seq.output_token_ids)
                before = len(state.text)
                self.detok.feed(state, new_ids, params.skip_special_tokens)
                # A sequence ended by a stop token still gets its text checked: the string may have
                # completed on an earlier token of this step's text.
                if (
                    params.stop
                    and seq.stop_reason is None
                    and seq.status is not SequenceStatus.FINISHED_ABORTED
                ):
                    self._check_stop_strings(seq, state, before, group, scheduler)

    def _check_stop_strings(
        self, seq: Sequence, state: _DetokState, before: int, group: SequenceGroup, scheduler: Scheduler
    ) -> None:
        params = group.sampling_params
        if len(seq.output_token_ids) < params.min_tokens:
            return
        best = find_stop_string(state.text, params.stop, before)
        if best is None:
            return
        idx, stop = best
        state.text = state.text[: idx + len(stop)] if params.include_stop_str_in_output else state.text[:idx]
        if seq.is_finished:  # finished by length on the same token: the stop string wins, as in vLLM
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop
        else:
            scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED, stop_reason=stop)

    def _state(self, seq: Sequence) -> _DetokState:
        state = self._states.get(seq.seq_id)
        if state is None:
            assert self.detok is not None
            state = self.detok.start(seq.prompt_token_ids)
            self._states[seq.seq_id] = state
        return state

    def text_of(self, seq: Sequence) -> str:
        state = self._states.get(seq.seq_id)
        return state.text if state is not None else ""

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        seqs = list(group.seqs)
        if group.is_finished and len(seqs) > params.n:
            # best_of > n: return the n most likely samples (vLLM ranks by cumulative logprob).
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        else:
            seqs = seqs[: params.n]
        outputs = [
            CompletionOutput(
                index=i,
                text=self.text_of(seq),
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                logprobs=[self._convert(e) for e in seq.output_logprobs]
                if params.logprobs is not None
                else None,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(seqs)
        ]
        prompt_logprobs = None
        if group.prompt_logprobs is not None:
            prompt_logprobs = [None if e is None else self._convert(e) for e in group.prompt_logprobs]
        finished = group.is_finished
        if finished:
            for seq in group.seqs:
                self._states.pop(seq.seq_id, None)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics=RequestMetrics(
                arrival_time=group.arrival_time,
                first_scheduled_time=group.first_scheduled_time,
                first_token_time=group.first_token_time,
                finished_time=group.finished_time,
            ),
            error=group.error,
        )

    def _convert(self, entry: TokenLogprobs) -> PositionLogprobs:
        detok = self.detok
        return {
            tok: Logprob(logprob=lp, rank=rank, decoded_token=detok.decode([tok], False) if detok else None)
            for tok, (lp, rank) in entry.items()
        }
