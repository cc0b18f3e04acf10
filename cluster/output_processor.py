"""The one road from a step's results to what users see: `RequestDelta`s.

After the scheduler has appended a step's tokens (and decided the token-level stops: EOS,
stop_token_ids, max_tokens, max_model_len), the engine hands the changed requests here. For each
live sample this module, and only this module:

- detokenizes the new tokens incrementally (`cluster.detokenizer`),
- looks for stop strings token by token (`find_stop_string`), trims the text at one
  (`trim_at_stop`) and drops any tokens after the one that completed it,
- holds back text that could still turn into a stop string (`held_back_len`),
- converts logprobs (decoded token text included),
- reports finish reasons, and for `best_of > n` picks the n best samples (`select_best_of`)
  once all are done, sending nothing for such a request before that.

It never touches the scheduler: a sample ended by a stop string is returned to the engine,
which finishes it there at once (freeing its blocks). What was already handled is tracked once
per sample (`_Sample.num_tokens`, the output tokens consumed); a request's state is dropped with
its final delta.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cluster.detokenizer import DetokState, IncrementalDetokenizer
from cluster.outputs import Logprob, PositionLogprobs, PromptInfo, RequestDelta, RequestMetrics, SampleDelta
from request.sampling_params import SamplingParams
from scheduler.outputs import TokenLogprobs
from scheduler.sequence import Sequence, SequenceGroup


def find_stop_string(text: str, stops: tuple[str, ...], num_searched: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` as (index, stop), or None.

    `text[:num_searched]` was searched before (and held no stop string), so only matches that end
    after it are possible: the search starts `len(longest stop) - 1` characters before it.
    """
    search_from = max(0, num_searched - max(len(s) for s in stops) + 1)
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, search_from)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def trim_at_stop(text: str, idx: int, stop: str, include_stop_str_in_output: bool) -> str:
    """The text a stop string at `idx` leaves: up to it, or up to its end when it is to be included."""
    return text[: idx + len(stop)] if include_stop_str_in_output else text[:idx]


def held_back_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string: text that
    must not be released yet, because the next token may complete a stop string out of it."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


@dataclass(slots=True)
class _Sample:
    """One sequence as the user sees it."""

    seq: Sequence
    detok: DetokState
    num_tokens: int = 0  # output tokens of `seq` consumed here (the only "already handled" count)
    pending: str = ""  # decoded text not released yet (it may still become a stop string)
    tail: str = ""  # the last (longest stop - 1) released characters: a stop string may begin there
    finish_reason: str | None = None  # decided (here or by the scheduler); the final SampleDelta went out
    stop_reason: int | str | None = None
    held: list[SampleDelta] = field(default_factory=list)  # best_of > n: deltas kept until the choice is made


@dataclass(slots=True)
class _Request:
    group: SequenceGroup
    params: SamplingParams  # the group's (frozen: read once here, not per step)
    # best_of > n: nothing is sent until every sample finished and the best n are chosen.
    holds: bool
    samples: dict[int, _Sample] = field(default_factory=dict)  # seq_id -> sample
    prompt_sent: bool = False


def select_best_of(samples: list[_Sample], n: int) -> list[_Sample]:
    """The n samples with the highest cumulative logprob (vLLM's ranking for best_of), best first."""
    return sorted(samples, key=lambda s: s.seq.cumulative_logprob, reverse=True)[:n]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self._requests: dict[str, _Request] = {}

    def add_request(self, group: SequenceGroup) -> None:
        params = group.sampling_params
        self._requests[group.request_id] = _Request(group, params, params.actual_best_of > params.n)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def process(self, groups: Iterable[SequenceGroup]) -> tuple[list[RequestDelta], list[tuple[Sequence, str]]]:
        """Deltas for the requests among `groups` that changed, and the sequences a stop string ended
        (the caller finishes those in the scheduler). A request's final delta is produced once."""
        deltas: list[RequestDelta] = []
        stopped: list[tuple[Sequence, str]] = []
        for group in groups:
            req = self._requests.get(group.request_id)
            if req is None or req.group is not group:  # already finished here (or never added)
                continue
            delta = self._process_request(req, stopped)
            if delta is not None:
                deltas.append(delta)
        return deltas, stopped

    def _process_request(self, req: _Request, stopped: list[tuple[Sequence, str]]) -> RequestDelta | None:
        group = req.group
        samples = req.samples
        seqs = group.seqs
        if len(seqs) == 1 and not req.holds:  # the common request (n = best_of = 1): its one sample decides
            seq = seqs[0]
            sample = samples.get(seq.seq_id)
            if sample is None:
                sample = samples[seq.seq_id] = self._new_sample(req, seq)
            one = self._process_sample(req, sample, stopped)
            finished = sample.finish_reason is not None
            if one is None and not finished:
                return None
            return self._request_delta(req, [] if one is None else [one], finished)
        changed: list[SampleDelta] = []
        for seq in seqs:
            sample = samples.get(seq.seq_id)
            if sample is None:
                sample = samples[seq.seq_id] = self._new_sample(req, seq)
            delta = self._process_sample(req, sample, stopped)
            if delta is not None:
                changed.append(delta)
        finished = True  # (a loop, not all() over a generator: this runs for every request every step)
        for sample in samples.values():
            if sample.finish_reason is None:
                finished = False
                break
        if req.holds:
            by_index = {s.seq.sample_index: s for s in req.samples.values()}
            for d in changed:
                by_index[d.index].held.append(d)
            if not finished:
                return None
            chosen = select_best_of(list(req.samples.values()), req.params.n)
            changed = [_merge(s.held, i) for i, s in enumerate(chosen)]
        if not changed and not finished:
            return None
        return self._request_delta(req, changed, finished)

    def _request_delta(self, req: _Request, changed: list[SampleDelta], finished: bool) -> RequestDelta:
        """The request's delta of this step (its prompt once, its metrics and release when it finished)."""
        group = req.group
        out = RequestDelta(request_id=group.request_id, samples=changed, finished=finished)
        if not req.prompt_sent:
            req.prompt_sent = True
            out.prompt = self._prompt_info(group)
        if finished:
            out.metrics = RequestMetrics(
                arrival_time=group.arrival_time,
                first_scheduled_time=group.first_scheduled_time,
                first_token_time=group.first_token_time,
                # A stop string decided here ends the request before the scheduler retires it.
                finished_time=group.finished_time if group.finished_time is not None else time.monotonic(),
            )
            out.error = group.error
            out.pooled = group.pooled
            del self._requests[group.request_id]
        return out

    def _new_sample(self, req: _Request, seq: Sequence) -> _Sample:
        params = req.params
        state = self.detok.start(seq.prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens)
        return _Sample(seq=seq, detok=state)

    def _process_sample(self, req: _Request, s: _Sample, stopped: list[tuple[Sequence, str]]) -> SampleDelta | None:
        """Consume the sample's new tokens; its delta, or None when nothing is new."""
        if s.finish_reason is not None:
            return None  # its final delta went out; tokens the scheduler still appended are dropped
        seq, params = s.seq, req.params
        start = s.num_tokens
        output_ids = seq.output_token_ids
        new_ids = output_ids[start:]
        s.num_tokens = len(output_ids)
        taken = len(new_ids)
        stop = None
        detok_step, state = self.detok.step, s.detok
        if not params.stop:  # the common case: nothing to search, the text goes out whole (_release)
            if taken == 1:
                text = s.pending + detok_step(state, new_ids[0])
            else:
                text = s.pending + "".join([detok_step(state, tok) for tok in new_ids])
            s.pending = ""
            if seq.is_finished:
                s.finish_reason, s.stop_reason = seq.status.finish_reason, seq.stop_reason
        else:
            for i, tok in enumerate(new_ids):
                searched = len(s.tail) + len(s.pending)
                s.pending += detok_step(state, tok)
                if start + i + 1 >= params.min_tokens:
                    stop = self._check_stop_strings(s, params, searched)
                    if stop is not None:
                        taken = i + 1  # tokens after the one completing the stop string are not part of the output
                        break
            if stop is not None:
                s.finish_reason, s.stop_reason = "stop", stop
                if not seq.is_finished:
                    stopped.append((seq, stop))
            elif seq.is_finished:
                s.finish_reason, s.stop_reason = seq.status.finish_reason, seq.stop_reason
            text = self._release(s, params)
        if not taken and not text and s.finish_reason is None:
            return None
        want = params.logprobs is not None
        return SampleDelta(
            index=seq.sample_index,
            text=text,
            token_ids=new_ids if taken == len(new_ids) else new_ids[:taken],
            logprobs=[self._convert(e) for e in seq.output_logprobs[start : start + taken]] if want else None,
            cumulative_logprob=seq.cumulative_logprob if want else None,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )

    @staticmethod
    def _check_stop_strings(s: _Sample, params: SamplingParams, searched: int) -> str | None:
        """The stop string the latest token completed (trimming `s.pending` at it), or None."""
        window = s.tail + s.pending
        hit = find_stop_string(window, params.stop, searched)
        if hit is None:
            return None
        idx, stop = hit
        kept = trim_at_stop(window, idx, stop, params.include_stop_str_in_output)
        s.pending = kept[len(s.tail) :]  # released text is never taken back
        return stop

    @staticmethod
    def _release(s: _Sample, params: SamplingParams) -> str:
        """The pending text that can go out now."""
        if s.finish_reason is not None or not params.stop:
            text, s.pending = s.pending, ""
            return text
        hold = 0 if params.include_stop_str_in_output else held_back_len(s.tail + s.pending, params.stop)
        hold = min(hold, len(s.pending))
        text = s.pending[: len(s.pending) - hold]
        s.pending = s.pending[len(s.pending) - hold :]
        keep = max(len(stop) for stop in params.stop) - 1
        s.tail = (s.tail + text)[-keep:] if keep else ""
        return text

    def _prompt_info(self, group: SequenceGroup) -> PromptInfo:
        logprobs = None
        if group.prompt_logprobs is not None:
            logprobs = [None if e is None else self._convert(e) for e in group.prompt_logprobs]
        return PromptInfo(
            prompt=group.prompt,
            token_ids=group.prompt_token_ids,
            logprobs=logprobs,
            num_cached_tokens=group.num_cached_tokens,
        )

    def _convert(self, entry: TokenLogprobs) -> PositionLogprobs:
        decode = self.detok.decode_token
        return {tok: Logprob(logprob=lp, rank=rank, decoded_token=decode(tok)) for tok, (lp, rank) in entry.items()}


def _merge(deltas: list[SampleDelta], index: int) -> SampleDelta:
    """A held sample's deltas as one, renumbered to its place among the chosen."""
    last = deltas[-1]
    logprobs = None if last.logprobs is None else [e for d in deltas for e in (d.logprobs or [])]
    return SampleDelta(
        index=index,
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        logprobs=logprobs,
        cumulative_logprob=last.cumulative_logprob,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
    )
