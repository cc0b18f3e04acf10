"""ModelRunner: turns one SchedulerOutput into tensors, runs the model, samples on rank 0.

Per-sequence state (tokens, block table, sampling params) lives here between steps,
updated from the scheduler's deltas, so the controller never resends whole contexts.
Every rank runs the same forward and the same `compute_logits` (the logits gather is
a collective); only rank 0 samples and answers.

Input preparation is vectorised over the batch: positions, slot mapping and block
tables are computed with tensor ops from per-row (computed, scheduled) counts; the
only per-row Python work is slicing each row's new token ids and padding its block list
(one tensor is built from all of them).

With LoRA (`lora`, a LoRAManager) each sequence keeps its adapter id; the rows are ordered by adapter within
the decodes and within the prefills, and the step's token groups per adapter are built once and set on the
rank's LoRA context around the forward (model_exec/lora/context.py).

On CUDA the host inputs travel as pinned, non-blocking copies (the host never waits for them), and a
pure-decode step replays the CUDA graph of its batch-size bucket when graphs are attached
(`model_exec/cuda_graphs.py`). On the CPU the "copies" are the host tensors themselves.

`execute` runs a step whole (the synchronous road, the step thread, every TP rank); `launch` splits it for the
in-process executor's asynchronous step: enqueue now, resolve later, the samples kept on the device
(model_exec/step_launch.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model_exec.cuda_graphs import DecodeGraphs, DecodeInputs
from model_exec.draft_model import DraftModel, has_placeholders
from model_exec.layers.quantization import row_roads
from model_exec.lora.manager import LoRAManager
from model_exec.models import CausalLM
from model_exec.parallel import TPGroup
from model_exec.pooler import Pooler
from model_exec.readback import reader_for
from model_exec.sampler import Sampler, SamplingMetadata
from model_exec.spec_verify import RowToSample, sample_rows
from model_exec.step_launch import LaunchedStep, launch_step
from ops.attention.base import AttentionMetadata
from ops.cache_ops import KVCache
from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams
from scheduler.outputs import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput, SeqSample, TokenLogprobs

# The profile step's sampler pass: the heaviest per-row work the sampler does (penalties count tokens over
# [rows, V], top-p may sort whole rows, logprobs keep a [rows, V] log_softmax), so its temporaries are in
# the peak that sizes the KV pool.
_PROFILE_SAMPLING = SamplingParams(
    temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1, frequency_penalty=0.1, logprobs=5
)


@dataclass
class _SeqState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # appended from scheduler deltas (tokens rank 0 sampled earlier)
    block_ids: list[int]
    params: SamplingParams
    seed: int
    sample_index: int
    lora_id: int  # the sequence's adapter (NewSeqData.lora_id); 0: the base model
    pooling_params: PoolingParams | None = None  # a pooling request (NewSeqData.pooling_params)

    def token_slice(self, start: int, stop: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    def token_at(self, pos: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < num_prompt else self.output_token_ids[pos - num_prompt]


@dataclass
class _HostStep:
    """One step's model inputs on the host (CPU tensors), and what the step reads of them in Python."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    starts: list[int]  # query_start_loc as Python ints (no device read)
    max_query_len: int
    num_decodes: int
    # [T] bool: the row's token was generated (position >= its prompt's length); picks its GGUF road
    # (model_exec/layers/quantization/row_roads.py)
    generated: torch.Tensor
    # The launched step (model_exec/step_launch.py): writes the ids the host does not know yet into the
    # input ids once they are on the device (the last step's samples, kept there).
    fill_ids: Callable[[torch.Tensor], None] | None = None


@dataclass
class _Row:
    seq_id: int
    state: _SeqState
    num_computed: int
    num_scheduled: int  # proposals included
    drafts: list[int]  # speculative decoding: the proposals run after the row's known tokens ([] for most rows)

    def input_ids(self) -> list[int]:
        known = self.state.token_slice(self.num_computed, self.num_computed + self.num_scheduled - len(self.drafts))
        return known + self.drafts if self.drafts else known


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        tp: TPGroup,
        block_size: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
        lora: LoRAManager | None = None,
        pooler: Pooler | None = None,
    ) -> None:
        self.model = model
        self.pooler = pooler  # runner="pooling": every step pools its rows instead of sampling
        self.lora = lora  # the rank's adapters, with enable_lora only
        self.tp = tp
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.seqs: dict[int, _SeqState] = {}
        # Rank 0: the token it last sampled for each sequence. Under the asynchronous step the scheduler sends a
        # placeholder for it (scheduler.outputs.PLACEHOLDER_TOKEN) before it has seen the sample: this fills it.
        self.last_sampled: dict[int, int] = {}
        self._pinned = device.type == "cuda"
        self.decode_graphs: DecodeGraphs | None = None  # set by attach_decode_graphs (CUDA, after the KV pool)
        self.draft: DraftModel | None = None  # rank 0 with a draft model (speculative decoding): proposes
        # The launch/resolve road (`launch`): results read back on a side stream, and the step launched last,
        # whose sampled ids (still on the device) the next step's placeholders read.
        self.reader = reader_for(device)
        self.last_launch: LaunchedStep | None = None

    def attach_decode_graphs(self, graphs: DecodeGraphs) -> None:
        """Pure-decode steps replay these graphs from now on (the KV pool they captured must stay)."""
        # a captured graph replays the base model only: it never sees the step's LoRA context
        assert self.lora is None, "CUDA graphs are not captured with LoRA"
        self.decode_graphs = graphs

    # ------------------------------------------------------------------ state
    def _apply_deltas(self, so: SchedulerOutput) -> tuple[list[_Row], list[tuple[int, _SeqState]]]:
        """The step's rows (sorted as the backends take them), and the sequences whose newest token is the
        scheduler's placeholder for a sample not seen yet (filled by `_fill_placeholders` or on the device)."""
        for seq_id in so.finished_seq_ids:
            self.seqs.pop(seq_id, None)
            self.last_sampled.pop(seq_id, None)
        rows: list[_Row] = []
        placeheld: list[tuple[int, _SeqState]] = []
        for new in so.new_seqs:
            state = _SeqState(
                prompt_token_ids=new.token_ids[: new.num_prompt_tokens],
                output_token_ids=new.token_ids[new.num_prompt_tokens :],
                block_ids=list(new.block_ids),
                params=new.sampling_params,
                seed=new.seed,
                sample_index=new.sample_index,
                lora_id=new.lora_id,
                pooling_params=new.pooling_params,
            )
            self.seqs[new.seq_id] = state
            drafts = so.spec_token_ids.get(new.seq_id, [])
            rows.append(_Row(new.seq_id, state, new.num_computed_tokens, new.num_scheduled_tokens, drafts))
        for cached in so.cached_seqs:
            state = self.seqs[cached.seq_id]
            state.output_token_ids.extend(cached.new_token_ids)
            if cached.new_token_ids and cached.new_token_ids[-1] == PLACEHOLDER_TOKEN:
                placeheld.append((cached.seq_id, state))
            del state.block_ids[cached.num_kept_blocks :]
            state.block_ids.extend(cached.new_block_ids)
            drafts = so.spec_token_ids.get(cached.seq_id, [])
            rows.append(_Row(cached.seq_id, state, cached.num_computed_tokens, cached.num_scheduled_tokens, drafts))
        # Attention backends take decode rows (one new token) first; within each kind rows of one adapter sit
        # together, so each adapter's tokens form at most two contiguous ranges (LoRA slices, never gathers).
        rows.sort(key=lambda r: (r.num_scheduled != 1, r.state.lora_id))
        return rows, placeheld

    def _fill_placeholders(self, placeheld: list[tuple[int, _SeqState]]) -> None:
        """Put the tokens rank 0 sampled last step in place of the scheduler's placeholders, on every rank
        (only rank 0 samples: the others receive them in one broadcast; every rank sees the same list)."""
        tokens = torch.tensor(
            [self.last_sampled.pop(seq_id) if self.tp.rank == 0 else 0 for seq_id, _ in placeheld], dtype=torch.long
        )
        if self.tp.world_size > 1:  # NCCL broadcasts device tensors only
            tokens = self.tp.broadcast(tokens.to(self.device))
        filled = tokens.tolist()
        for (_, state), token in zip(placeheld, filled, strict=True):
            state.output_token_ids[-1] = token

    # ------------------------------------------------------------------ inputs
    def _host_inputs(self, rows: list[_Row]) -> _HostStep:
        if all(r.num_scheduled == 1 for r in rows):
            return self._decode_inputs(rows)
        return self._spread_inputs(rows)

    def _spread_inputs(self, rows: list[_Row]) -> _HostStep:
        """Any step's inputs: each row's query spread over its tokens with tensor ops."""
        q_lens_list = [r.num_scheduled for r in rows]
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(r.input_ids() for r in rows)),
            dtype=torch.long,
        )
        q_lens = torch.tensor(q_lens_list, dtype=torch.int32)
        computed = torch.tensor([r.num_computed for r in rows], dtype=torch.int32)
        seq_lens = computed + q_lens
        query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, dim=0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        row_of_token = torch.repeat_interleave(torch.arange(len(rows)), q_lens)
        positions = (
            torch.arange(num_tokens, dtype=torch.int32) - query_start_loc[:-1][row_of_token] + computed[row_of_token]
        ).long()
        block_tables = _block_tables(rows, max(len(r.state.block_ids) for r in rows))
        block_of_token = block_tables[row_of_token, positions // self.block_size].long()
        slot_mapping = block_of_token * self.block_size + positions % self.block_size
        num_prompt = torch.tensor([len(r.state.prompt_token_ids) for r in rows])
        return _HostStep(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            starts=query_start_loc.tolist(),
            max_query_len=max(q_lens_list),
            num_decodes=sum(1 for n in q_lens_list if n == 1),
            generated=positions >= num_prompt[row_of_token],
        )

    def _decode_inputs(self, rows: list[_Row]) -> _HostStep:
        """`_host_inputs` of a step of one token per row, in one pass over the rows: the same tensors, without
        the ops that spread each row's query over its tokens (a row's one token sits at its computed count).
        Small torch ops cost more than these Python lines when the cores are busy. A one-token row with a
        proposal (the draft model's passes, model_exec/draft_model.py) runs that proposal, as `_Row.input_ids`."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        generated: list[bool] = []
        max_blocks = 0
        for r in rows:
            state, pos = r.state, r.num_computed
            num_prompt = len(state.prompt_token_ids)
            generated.append(pos >= num_prompt)
            if r.drafts:
                input_ids.append(r.drafts[0])
            else:
                input_ids.append(
                    state.prompt_token_ids[pos] if pos < num_prompt else state.output_token_ids[pos - num_prompt]
                )
            positions.append(pos)
            slots.append(state.block_ids[pos // bs] * bs + pos % bs)
            max_blocks = max(max_blocks, len(state.block_ids))
        positions_t = torch.tensor(positions, dtype=torch.long)
        num_rows = len(rows)
        return _HostStep(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            positions=positions_t,
            query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32),
            seq_lens=(positions_t + 1).to(torch.int32),
            block_tables=_block_tables(rows, max_blocks),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            starts=list(range(num_rows + 1)),
            max_query_len=1,
            num_decodes=num_rows,
            generated=torch.tensor(generated, dtype=torch.bool),
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device: pinned and non-blocking on CUDA (the pinned block is recycled only
        once the copy is done: torch's caching host allocator records the copy's event); itself on the CPU."""
        if self._pinned:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _forward(self, host: _HostStep, kv_caches: list[KVCache]) -> torch.Tensor:
        """Hidden states of the step's tokens (a graph's padded output may carry extra rows at the end)."""
        if self.decode_graphs is not None and host.max_query_len == 1:
            hidden = self.decode_graphs.run(
                DecodeInputs(host.input_ids, host.positions, host.slot_mapping, host.seq_lens, host.block_tables),
                host.fill_ids,
            )
            if hidden is not None:
                return hidden
        return self._eager_forward(self.model, host, kv_caches)

    def _eager_forward(self, model: CausalLM, host: _HostStep, kv_caches: list[KVCache]) -> torch.Tensor:
        """`model`'s hidden states of the step's tokens, run eagerly (the target, or the draft on its own pool)."""
        meta = AttentionMetadata(
            query_start_loc=self._to_device(host.query_start_loc),
            seq_lens=self._to_device(host.seq_lens),
            block_tables=self._to_device(host.block_tables),
            slot_mapping=self._to_device(host.slot_mapping),
            max_query_len=host.max_query_len,
            max_seq_len=int(host.seq_lens.max()),
            num_decodes=host.num_decodes,
        )
        input_ids = self._to_device(host.input_ids)
        if host.fill_ids is not None:
            host.fill_ids(input_ids)
        with row_roads.step(host.generated):
            return model(input_ids, self._to_device(host.positions), kv_caches, meta)

    def _fill_proposals(self, rows: list[_Row]) -> None:
        """Speculative decoding with a draft model: rank 0's draft runs over the step (every step: its KV
        follows the target's) and fills the rows' placeholder proposals; the other ranks receive them in one
        broadcast (every rank sees the same placeholder rows, in the same order)."""
        speculating = [r for r in rows if has_placeholders(r)]
        if self.draft is not None:
            self.draft.propose(rows, self._host_inputs, self._eager_forward)
        if self.tp.world_size == 1 or not speculating:
            return
        flat = (
            [t for r in speculating for t in r.drafts]
            if self.tp.rank == 0
            else [0] * sum(len(r.drafts) for r in speculating)
        )
        filled = self.tp.broadcast(torch.tensor(flat, dtype=torch.long, device=self.device)).tolist()
        for r in speculating:
            r.drafts, filled = filled[: len(r.drafts)], filled[len(r.drafts) :]

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(
        self, so: SchedulerOutput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> ModelRunnerOutput | None:
        """One step, whole: inputs, forward, samples read back (the synchronous road, and every TP rank)."""
        rows, placeheld = self._apply_deltas(so)
        if placeheld:
            self._fill_placeholders(placeheld)
        return self.run_rows(rows, so, kv_caches)

    def launch(self, so: SchedulerOutput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> LaunchedStep:
        """`execute` in two halves (model_exec/step_launch.py): returns once the step is enqueued; the
        returned step's `resolve` gives its output. Rank 0 of a one-rank group only (the in-process executor)."""
        return launch_step(self, so, kv_caches)

    def forward_rows(self, rows: list[_Row], host: _HostStep, kv_caches: list[KVCache]) -> torch.Tensor:
        """The step's hidden states, under its rows' LoRA adapters."""
        if self.lora is not None:
            with self.lora.batch([r.state.lora_id for r in rows], host.starts):
                return self._forward(host, kv_caches)
        if any(r.state.lora_id for r in rows):
            raise ValueError("the step runs a LoRA adapter, but this engine was started without enable_lora")
        return self._forward(host, kv_caches)

    @torch.inference_mode()
    def run_rows(
        self, rows: list[_Row], so: SchedulerOutput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> ModelRunnerOutput | None:
        """`execute` past its deltas: every token the rows read is known on the host."""
        if not rows:
            return ModelRunnerOutput() if self.tp.rank == 0 else None
        if self.draft is not None or any(has_placeholders(r) for r in rows):
            self._fill_proposals(rows)
        host = self._host_inputs(rows)
        hidden = self.forward_rows(rows, host, kv_caches)
        if self.pooler is not None:
            return self._pool(rows, hidden, host.starts)

        # Which hidden rows need logits: the last token of every row that samples (a speculative row: its
        # last token and every proposal), then the prompt positions whose logprobs were asked for. Same
        # selection on every rank (gather is collective).
        starts = host.starts
        sample_rows = [i for i, r in enumerate(rows) if r.seq_id in so.num_samples]
        if host.max_query_len == 1 and not any(r.drafts for r in rows):  # pure decode: row i's token is hidden row i
            select = list(sample_rows)
        else:
            select = [p for i in sample_rows for p in range(starts[i + 1] - 1 - len(rows[i].drafts), starts[i + 1])]
        num_sample_logits = len(select)
        plp_spans: list[tuple[int, int, int]] = []  # (row, first position, count)
        plp_wanted = set(so.prompt_logprobs_seq_ids)
        for i, r in enumerate(rows):
            if r.seq_id not in plp_wanted:
                continue
            last = min(r.num_computed + r.num_scheduled, len(r.state.prompt_token_ids) - 1)
            count = max(0, last - r.num_computed)
            plp_spans.append((i, len(select), count))
            select.extend(range(starts[i], starts[i] + count))
        if not select:
            return ModelRunnerOutput() if self.tp.rank == 0 else None
        logits = self.model.compute_logits(hidden[self._to_device(torch.tensor(select))])
        if logits is None:  # ranks other than 0: the gather delivered the logits to rank 0 only
            return None
        logits = logits.float()
        out = ModelRunnerOutput()
        if sample_rows:
            samples = self._sample([rows[i] for i in sample_rows], logits[:num_sample_logits], so)
            for i, sample in zip(sample_rows, samples, strict=True):
                out.samples[rows[i].seq_id] = sample
                # a fork's parent keeps draw 0; a speculative row's newest token ends its accepted run
                self.last_sampled[rows[i].seq_id] = sample.token_ids[-1 if rows[i].drafts else 0]
        for i, offset, count in plp_spans:
            r = rows[i]
            targets = [r.state.token_at(p + 1) for p in range(r.num_computed, r.num_computed + count)]
            out.prompt_logprobs[r.seq_id] = _top_logprobs(
                logits[offset : offset + count], targets, r.state.params.prompt_logprobs or 0
            )
        return out

    def _pool(self, rows: list[_Row], hidden: torch.Tensor, starts: list[int]) -> ModelRunnerOutput | None:
        """A pooling step: every row is a whole prompt (no chunked prefill, no prefix cache, no decode)."""
        assert self.pooler is not None
        if self.tp.rank != 0:
            return None
        params: list[PoolingParams] = []
        for r in rows:
            if r.state.pooling_params is None or r.num_computed or r.num_scheduled != len(r.state.prompt_token_ids):
                raise ValueError(f"sequence {r.seq_id}: a pooling step runs whole prompts of pooling requests only")
            params.append(r.state.pooling_params)
        vectors = self.pooler(hidden, starts, params)
        return ModelRunnerOutput(pooled={r.seq_id: v for r, v in zip(rows, vectors, strict=True)})

    def steady_meta(self, rows: list[_Row], so: SchedulerOutput) -> SamplingMetadata:
        """The steady batch (no proposals, no grammar): the sampler's lists straight from the rows' state, what
        sample_rows builds for it through one RowToSample per row and its virtual rows."""
        states = [r.state for r in rows]
        num_samples = so.num_samples
        return SamplingMetadata(
            params=[s.params for s in states],
            seeds=[s.seed for s in states],
            sample_indices=[s.sample_index for s in states],
            output_lens=[len(s.output_token_ids) for s in states],
            num_samples=[num_samples[r.seq_id] for r in rows],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            eos_token_ids=self.eos_token_ids,
        )

    def _sample(self, rows: list[_Row], logits: torch.Tensor, so: SchedulerOutput) -> list[SeqSample]:
        """One SeqSample per row; a speculative row owns len(drafts) + 1 logits rows (model_exec/spec_verify.py)."""
        if so.grammar_bitmask is None and not any(r.drafts for r in rows):
            return self.sampler(logits, self.steady_meta(rows, so))
        bitmask: dict[int, np.ndarray] = {}
        if so.grammar_bitmask is not None:
            bitmask = {seq_id: so.grammar_bitmask[j] for j, seq_id in enumerate(so.structured_seq_ids)}
        return sample_rows(
            self.sampler,
            logits,
            [
                RowToSample(
                    params=r.state.params,
                    seed=r.state.seed,
                    sample_index=r.state.sample_index,
                    prompt_token_ids=r.state.prompt_token_ids,
                    output_token_ids=r.state.output_token_ids,
                    num_samples=so.num_samples[r.seq_id],
                    drafts=r.drafts,
                    grammar_mask=bitmask.get(r.seq_id),
                )
                for r in rows
            ],
            self.eos_token_ids,
        )


def _block_tables(rows: list[_Row], max_blocks: int) -> torch.Tensor:
    """int32 [rows, max_blocks]: one tensor from the padded lists (a tensor per row cost ~40 us each: 256 rows,
    40 blocks: 11 -> 0.9 ms on 2 shared cores); pad entries are never read (a row reads the blocks its seq_len
    covers)."""
    return torch.tensor(
        [r.state.block_ids + [0] * (max_blocks - len(r.state.block_ids)) for r in rows], dtype=torch.int32
    )


def _top_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Per row: the top-k tokens and the target token, each with (logprob, rank)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    target_t = torch.tensor(targets, dtype=torch.long, device=logits.device)
    target_lp = logprobs.gather(1, target_t[:, None])
    ranks = (logprobs > target_lp).sum(dim=1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    result: list[TokenLogprobs] = []
    for j, target in enumerate(targets):
        entry: TokenLogprobs = {
            int(t): (float(lp), rank + 1)
            for rank, (t, lp) in enumerate(zip(top_ids[j].tolist(), top_lp[j].tolist(), strict=True))
        }
        entry[target] = (float(target_lp[j, 0]), int(ranks[j]))
        result.append(entry)
    return result


def profile_forward(
    runner: ModelRunner,
    num_tokens: int,
    num_logit_rows: int,
    make_cache: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]],
) -> None:
    """The step's peak memory: one prefill of `num_tokens` dummy tokens, then logits and a sampler pass
    (the sampler's heaviest settings) for `num_logit_rows` rows (max_num_seqs) on the rank that samples."""
    bs = runner.block_size
    num_blocks = -(-num_tokens // bs)
    caches = make_cache(num_blocks)
    with torch.inference_mode():
        dev = runner.device
        positions = torch.arange(num_tokens, device=dev)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None, :],
            slot_mapping=positions.clone(),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            num_decodes=0,
        )
        hidden = runner.model(torch.zeros(num_tokens, dtype=torch.long, device=dev), positions, caches, meta)
        # With more logit rows than tokens, token 0 fills the rest: the logits and the sampler see num_logit_rows rows.
        rows = torch.arange(num_tokens - num_logit_rows, num_tokens, device=dev).clamp_(min=0)
        logits = runner.model.compute_logits(hidden[rows])
        del hidden
        if logits is not None:  # the rank that samples
            runner.sampler(logits.float(), _profile_sampling(num_logit_rows, logits.shape[1]))
    del caches


def _profile_sampling(num_rows: int, vocab_size: int) -> SamplingMetadata:
    history = list(range(min(64, vocab_size)))  # some prompt and output tokens for the penalties to count
    return SamplingMetadata(
        params=[_PROFILE_SAMPLING] * num_rows,
        seeds=list(range(num_rows)),
        sample_indices=[0] * num_rows,
        output_lens=[len(history)] * num_rows,
        num_samples=[1] * num_rows,
        prompt_token_ids=[history] * num_rows,
        output_token_ids=[history] * num_rows,
    )
