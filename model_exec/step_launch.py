"""The model runner's step in two halves (vLLM V1's async step): `launch_step` returns once the step is
enqueued on the device, `LaunchedStep.resolve` waits for its results and builds the ModelRunnerOutput.

Used by the in-process executor under async_scheduling on CUDA (cluster/executor.py), with no step thread: the
host thread launches step N+1, then resolves step N while the device runs N+1.

Decisions and invariants:
- Step N's sampled ids stay on the device (model_exec/device_samples.py). Step N+1's rows whose newest token
  is the scheduler's placeholder for them read it there: their input ids are scattered from N's token tensor
  on the device (`_HostStep.fill_ids`, also into a CUDA graph's input buffer), never from the host. The copy
  of N's results to pinned host memory runs on a side stream (model_exec/readback.py); `resolve` waits on its
  event only.
- The host learns N's tokens at N's `resolve`, which writes them in place of the placeholders in the runner's
  own sequence state (it still reads them: penalties, a later recompute). Until then a placeholder row must not
  need its host history: a row under repetition / frequency / presence penalties (the sampler counts its output
  tokens on the host), a placeholder its step does not read, or a previous step that left no device tokens
  all fall back to the host: `resolve` N first (waiting for its copy), then launch. Correct, not overlapped.
- Steps the split does not cover run whole in the launch (`ModelRunner.run_rows`) and resolve at once: a fork
  (`best_of`), rows under a grammar, prompt logprobs, speculative rows, pooling, TP > 1. The pipeline waits
  for the first three anyway (cluster/async_step.py); async_scheduling refuses speculative decoding; the
  in-process executor has one rank.
- `resolve` is idempotent (the output is kept), so a fallback's early resolve and the pipeline's later one
  agree.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from model_exec.device_samples import DeviceSamples, sample_on_device
from model_exec.readback import Readback
from scheduler.outputs import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from model_exec.model_runner import ModelRunner, _Row, _SeqState


class LaunchedStep:
    """A step enqueued on the device: `resolve` gives its output (waiting for its readback)."""

    def __init__(
        self,
        sampled: list[tuple[int, _SeqState, int]],
        device: tuple[DeviceSamples, Readback] | None = None,
        output: ModelRunnerOutput | None = None,
    ) -> None:
        # (seq id, its state, the output index its sample lands at), in the order of the device tensors' rows
        self.sampled = sampled
        self._device = device
        self._output = output
        self.row_of = {seq_id: i for i, (seq_id, _, _) in enumerate(sampled)} if device is not None else {}

    @property
    def tokens(self) -> torch.Tensor | None:
        """The sampled ids on the device (row i: sampled[i]'s), None for a step run whole."""
        return self._device[0].tokens if self._device is not None else None

    def done(self) -> bool:
        """Whether `resolve` would return without waiting for the device."""
        return self._device is None or self._device[1].done()

    def wait(self) -> None:
        """Block until the results are on the host (the device API's event; nothing on the CPU)."""
        if self._device is not None:
            self._device[1].wait()

    def resolve(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._device is not None
            samples, readback = self._device
            readback.wait()
            out = ModelRunnerOutput()
            for (seq_id, _, _), sample in zip(self.sampled, samples.to_seq_samples(readback.host()), strict=True):
                out.samples[seq_id] = sample
            self._output = out
            self._device = None  # the device tensors may go
        output = self._output
        for seq_id, state, index in self.sampled:
            got = output.samples.get(seq_id)
            tokens = state.output_token_ids
            if got is not None and index < len(tokens) and tokens[index] == PLACEHOLDER_TOKEN:
                tokens[index] = got.token_ids[0]
        return output


def launch_step(
    runner: ModelRunner, so: SchedulerOutput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> LaunchedStep:
    """`ModelRunner.launch`: enqueue the step, keep its samples on the device, start their readback."""
    with torch.inference_mode():
        return _launch(runner, so, kv_caches)


def _launch(
    runner: ModelRunner, so: SchedulerOutput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> LaunchedStep:
    assert runner.tp.world_size == 1, "the launched step runs on a one-rank group (the in-process executor)"
    rows, placeheld = runner._apply_deltas(so)
    prev = runner.last_launch
    split = bool(rows) and _splits(runner, rows, so)
    fill = _device_fill(runner, rows, placeheld, prev) if split and placeheld else None
    if placeheld and fill is None:  # the host needs the tokens: wait for the step that sampled them
        if prev is not None:
            prev.resolve()
        if any(state.output_token_ids[-1] == PLACEHOLDER_TOKEN for _, state in placeheld):
            raise RuntimeError("a placeholder token with no launched step that sampled it")
    if not split:
        out = runner.run_rows(rows, so, kv_caches)
        assert out is not None  # rank 0
        step = LaunchedStep(_sampled_at(rows, list(out.samples)), output=out)
        runner.last_launch = step
        return step
    host = runner._host_inputs(rows)
    host.fill_ids = fill
    hidden = runner.forward_rows(rows, host, kv_caches)
    sample_rows = [i for i, r in enumerate(rows) if r.seq_id in so.num_samples]
    if not sample_rows:
        step = LaunchedStep([], output=ModelRunnerOutput())
        runner.last_launch = step
        return step
    # one logits row per sampling row: its last token (a pure decode: hidden row i is row i's token)
    select = sample_rows if host.max_query_len == 1 else [host.starts[i + 1] - 1 for i in sample_rows]
    logits = runner.model.compute_logits(hidden[runner._to_device(torch.tensor(select))])
    assert logits is not None  # one rank: it samples
    sampling = [rows[i] for i in sample_rows]
    samples = sample_on_device(runner.sampler, logits.float(), runner.steady_meta(sampling, so))
    readback = runner.reader.start(samples.tensors())
    step = LaunchedStep(_sampled_at(sampling, [r.seq_id for r in sampling]), device=(samples, readback))
    runner.last_launch = step
    return step


def _splits(runner: ModelRunner, rows: list[_Row], so: SchedulerOutput) -> bool:
    """Whether the step's samples can stay on the device (the module note lists what runs whole)."""
    return (
        runner.pooler is None
        and runner.draft is None
        and so.grammar_bitmask is None
        and not so.prompt_logprobs_seq_ids
        and not any(r.drafts for r in rows)
        and all(n == 1 for n in so.num_samples.values())
    )


def _sampled_at(rows: list[_Row], seq_ids: list[int]) -> list[tuple[int, _SeqState, int]]:
    """(seq id, state, output index of its sample) for the rows of `seq_ids` that sample."""
    wanted = set(seq_ids)
    at: list[tuple[int, _SeqState, int]] = []
    for r in rows:
        if r.seq_id in wanted:
            # the sample is the token after the row's last scheduled one
            at.append((r.seq_id, r.state, r.num_computed + r.num_scheduled - len(r.state.prompt_token_ids)))
    return at


def _has_penalties(state: _SeqState) -> bool:
    p = state.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _device_fill(
    runner: ModelRunner, rows: list[_Row], placeheld: list[tuple[int, _SeqState]], prev: LaunchedStep | None
) -> Callable[[torch.Tensor], None] | None:
    """The scatter of `prev`'s device tokens into this step's input ids at its placeholders, or None when a
    placeholder needs the host (module note)."""
    if prev is None or prev.tokens is None:
        return None
    starts = list(accumulate((r.num_scheduled for r in rows), initial=0))
    row_index = {r.seq_id: i for i, r in enumerate(rows)}
    dst: list[int] = []
    src: list[int] = []
    for seq_id, state in placeheld:
        i, at = row_index.get(seq_id), prev.row_of.get(seq_id)
        if i is None or at is None or _has_penalties(state):
            return None
        r = rows[i]
        pos = len(state.prompt_token_ids) + len(state.output_token_ids) - 1  # the placeholder's position
        if not r.num_computed <= pos < r.num_computed + r.num_scheduled:
            return None
        dst.append(starts[i] + pos - r.num_computed)
        src.append(at)
    tokens = prev.tokens
    dst_t = runner._to_device(torch.tensor(dst, dtype=torch.long))
    src_t = runner._to_device(torch.tensor(src, dtype=torch.long))

    def fill(input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, dst_t, tokens.index_select(0, src_t))

    return fill
