"""The continuous-batching scheduler.

There is no separate prefill phase and decode phase: every step has a token budget
(`max_num_batched_tokens`) and a row budget (`max_num_seqs`) and fills them in this
order (vLLM's policy):

1. running requests: their decodes first, then their unfinished prompt chunks;
   when the KV pool cannot grow a decode, the newest running request is preempted
   (by recompute: free its blocks and put it back at the front of `waiting`; or by
   swap: copy its blocks to the CPU pool and park it in `swapped`);
2. swapped requests come back (oldest first), unless this step preempted;
3. waiting requests are admitted FCFS while blocks and budget last, unless this step
   preempted or something is still swapped out.

LoRA (vLLM's rule): the requests running or swapped out use at most `max_loras` distinct adapters, so no
step's batch holds more. A waiting request whose adapter would exceed that stays in its place while later
waiting requests with an adapter already active (or with none) are admitted past it. Guarantee against
starvation: requests with an adapter may pass it at most `max_num_seqs` times (one batch's worth); from then
on only requests without an adapter pass it, so its adapter slot frees once the active adapters' running
requests finish, and it is admitted next. Preemption, swap and recompute keep a request's adapter.

Blocks for a prompt are allocated whole at admission (prefix-cache hits included);
chunked prefill then computes the prompt over several steps inside those blocks.

Speculative decoding (`config.speculative`, scheduler/speculative.py): a running request's decode may carry
up to k proposed tokens, when the budget and the free blocks take them without preempting anyone; the
row's lookahead slots are allocated like any other, and once the verified run is known the sequence counts
only the accepted tokens as computed, the blocks past its tokens are freed (`BlockManager.trim`), and only
blocks of accepted tokens enter the prefix cache. Rows under a grammar, forks and pooling never speculate.
Every function here runs on the controller and touches no tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kv import AllocStatus, BlockManager
from kv.prefix_cache import salt_of
from request.lora import NO_LORA
from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.constraint import TokenConstraint
from scheduler.outputs import (
    PLACEHOLDER_TOKEN,
    CachedSeqData,
    ModelRunnerOutput,
    NewSeqData,
    SchedulerOutput,
    SeqSample,
)
from scheduler.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler.speculative import propose_ngram


@dataclass
class _Budget:
    tokens: int
    seqs: int


@dataclass(slots=True)  # one per scheduled row per step
class _Scheduled:
    group: SequenceGroup
    seq: Sequence
    num_tokens: int  # scheduled tokens, proposals included
    drafts: list[int] = field(default_factory=list)  # speculative decoding: the proposals this row verifies


def _in_prefill(group: SequenceGroup) -> bool:
    """Whether a live sequence of the group has more than one token to compute (a prompt, or a recompute)."""
    for s in group.seqs:
        if len(s.prompt_token_ids) + len(s.output_token_ids) - s.num_computed_tokens > 1 and not s.is_finished:
            return True
    return False


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._groups: dict[str, SequenceGroup] = {}  # every unfinished request, by id
        self._seq_owner: dict[int, SequenceGroup] = {}  # live seq_id -> its request
        self._next_seq_id = 0
        self._to_forget: list[int] = []  # seq ids the workers must drop at the next step
        self._scheduled: list[_Scheduled] = []  # what the last schedule() ran, for update()
        self._finished: list[SequenceGroup] = []  # finished since the last take_finished()
        self._prefix_caching = block_manager.enable_prefix_caching
        self._block_size = block_manager.block_size
        self.num_preemptions_recompute = 0
        self.num_preemptions_swap = 0
        self.num_prompt_tokens = 0  # prompt tokens of every request added
        self.num_generation_tokens = 0  # tokens sampled (appended to sequences) over the engine's life
        # Speculative decoding, over the engine's life (vLLM's spec_decode counters): rows that carried
        # proposals, tokens proposed, tokens accepted, and accepted per proposal position.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        k = config.speculative.num_speculative_tokens if config.speculative is not None else 0
        self.spec_accepted_per_pos = [0] * k

    # ------------------------------------------------------------------ requests
    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        seed: int,
        arrival_time: float | None = None,
        constraint: TokenConstraint | None = None,
        lora_id: int = NO_LORA,
        lora_load_generation: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> SequenceGroup:
        """`constraint`: the first sample's grammar matcher, in its start state (structured outputs).
        `lora_id`: the adapter the request runs with, loaded on the workers; `lora_load_generation`: which
        load of that id (the engine counts every load), so a re-used id never hits the KV cached under an
        adapter it named before. `pooling_params`: a pooling request, finished by the step that computes its
        prompt (the engine runs pooling requests without chunked prefill, so that is its first step)."""
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        seq = Sequence(
            seq_id=self.new_seq_id(),
            prompt_token_ids=prompt_token_ids,
            seed=seed,
            sample_index=0,
            constraint=constraint,
        )
        group = SequenceGroup(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params,
            seqs=[seq],
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            prompt_logprobs=[None] if sampling_params.prompt_logprobs is not None else None,
            lora_id=lora_id,
            cache_salt=salt_of((lora_id, lora_load_generation)) if lora_id != NO_LORA else None,
            pooling_params=pooling_params,
        )
        self._groups[request_id] = group
        self._seq_owner[seq.seq_id] = group
        self.waiting.append(group)
        self.num_prompt_tokens += len(prompt_token_ids)
        return group

    def abort_request(self, request_id: str) -> SequenceGroup | None:
        """Finish a request wherever it is and free everything it holds. Unknown ids are ignored."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        for seq in group.live_seqs():
            self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
        return group

    def get_group(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def num_requests_with_lora(self, lora_id: int) -> int:
        """Unfinished requests running with adapter `lora_id`."""
        return sum(1 for g in self._groups.values() if g.lora_id == lora_id)

    def active_loras(self) -> set[int]:
        """The adapters of the requests running or swapped out: at most max_loras of them."""
        return {g.lora_id for g in self.running + self.swapped if g.lora_id != NO_LORA}

    def waiting_loras(self) -> set[int]:
        return {g.lora_id for g in self.waiting if g.lora_id != NO_LORA}

    def finish_seq(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """End one sequence: free its blocks, tell the workers, and retire the request when it was the last."""
        assert status.is_finished
        if seq.is_finished:
            return
        group = self._seq_owner.pop(seq.seq_id)
        if seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER_TOKEN:
            seq.output_token_ids.pop()  # ended (aborted) while its sample was in flight: the sample is never shown
        seq.status = status
        seq.stop_reason = stop_reason
        self.block_manager.free(seq.seq_id)
        if seq.num_tokens_on_workers:
            self._to_forget.append(seq.seq_id)
        seq.forget_worker_state()
        if group.is_finished:
            self._retire(group)

    def take_finished(self) -> list[SequenceGroup]:
        """Requests that finished since the last call (each returned once)."""
        finished, self._finished = self._finished, []
        return finished

    def _retire(self, group: SequenceGroup) -> None:
        group.finished_time = time.monotonic()
        self._groups.pop(group.request_id, None)
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        self._finished.append(group)

    def _ignore(self, group: SequenceGroup, reason: str) -> None:
        group.error = reason
        for seq in group.live_seqs():
            self.finish_seq(seq, SequenceStatus.FINISHED_IGNORED)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = _Budget(tokens=self.config.max_num_batched_tokens, seqs=self.config.max_num_seqs)
        out = SchedulerOutput()
        self._scheduled = []
        preempted = self._schedule_running(budget, out)
        if not preempted:
            self._schedule_swapped(budget, out)
        if not preempted and not self.swapped:
            self._schedule_waiting(budget, out)
        self._fill_seq_data(out)
        out.finished_seq_ids, self._to_forget = self._to_forget, []
        return out

    def _schedule_running(self, budget: _Budget, out: SchedulerOutput) -> bool:
        """Decodes first, then prompt chunks; preempts the newest requests when blocks run out."""
        preempted = False
        decoding: list[SequenceGroup] = []
        in_prefill: list[SequenceGroup] = []
        for g in self.running:
            (in_prefill if _in_prefill(g) else decoding).append(g)
        scheduled: set[int] = set()
        victims: set[int] = set()  # ids of groups preempted earlier in this loop
        steady = self.config.speculative is None  # (with proposals every decode row takes the general path)
        for group in decoding + in_prefill:
            if id(group) in victims:
                continue
            if steady and self._try_decode(group, budget, out):
                scheduled.add(id(group))
                continue
            while True:
                plan = self._plan_tokens(group, budget)
                if plan is None:
                    break
                drafts = self._propose(group, plan, budget)
                if drafts:
                    spec_plan = [(seq, n + len(drafts.get(seq.seq_id, ()))) for seq, n in plan]
                    if self._can_grow_speculatively(plan, spec_plan):
                        self._commit(group, spec_plan, budget, out, drafts)
                        scheduled.add(id(group))
                        break
                if self._can_grow(plan):
                    self._commit(group, plan, budget, out)
                    scheduled.add(id(group))
                    break
                victim = next(g for g in reversed(self.running) if id(g) not in scheduled)
                self._preempt(victim, out)
                victims.add(id(victim))
                preempted = True
                if victim is group:
                    break
        return preempted

    def _try_decode(self, group: SequenceGroup, budget: _Budget, out: SchedulerOutput) -> bool:
        """The steady row (one sequence, one token to run) planned, checked and committed in one block-manager
        call: what `_plan_tokens`, `_can_grow` and `_commit` do for it, without their per-row lists. False,
        having changed nothing, for any other row or when the blocks run out: the general path then decides
        (and preempts) exactly as before."""
        seqs = group.seqs
        if len(seqs) != 1 or budget.tokens < 1 or budget.seqs < 1:
            return False
        seq = seqs[0]
        computed = seq.num_computed_tokens
        if len(seq.prompt_token_ids) + len(seq.output_token_ids) - computed != 1 or seq.is_finished:
            return False
        copies = self.block_manager.try_append_slots(seq.seq_id, computed + 1, computed)
        if copies is None:
            return False
        if copies:
            out.blocks_to_copy.extend(copies)
        self._scheduled.append(_Scheduled(group, seq, 1))
        budget.tokens -= 1
        budget.seqs -= 1
        return True

    def _schedule_swapped(self, budget: _Budget, out: SchedulerOutput) -> None:
        while self.swapped:
            group = self.swapped[0]
            seq_ids = [s.seq_id for s in group.live_seqs()]
            status = self.block_manager.can_swap_in(seq_ids)
            if status is AllocStatus.NEVER:
                self._ignore(group, "the request no longer fits the KV cache after being swapped out")
                continue
            if status is AllocStatus.LATER or budget.seqs < len(seq_ids):
                return
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(seq_ids))
            for seq in group.live_seqs():
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            plan = self._plan_tokens(group, budget)
            if plan is not None and self._can_grow(plan):
                self._commit(group, plan, budget, out)

    def _schedule_waiting(self, budget: _Budget, out: SchedulerOutput) -> None:
        bm = self.block_manager
        active = self.active_loras()
        held: SequenceGroup | None = None  # the oldest waiting request the adapter limit holds back
        i = 0  # waiting[:i] are held back this step (adapter limit); the rest is FCFS as before
        while i < len(self.waiting) and budget.tokens > 0:
            group = self.waiting[i]
            seqs = group.live_seqs()
            longest = max(s.num_tokens for s in seqs)
            if longest > self.config.max_model_len:
                self.waiting.pop(i)
                self._ignore(
                    group,
                    f"the prompt ({longest} tokens) is longer than max_model_len ({self.config.max_model_len})",
                )
                continue
            if group.lora_id != NO_LORA:
                if group.lora_id not in active and len(active) >= self.config.max_loras:
                    held = held or group
                    i += 1
                    continue
                if held is not None and held.num_lora_bypasses >= self.config.max_num_seqs:
                    i += 1  # `held` was passed enough: adapters wait behind it until its slot frees
                    continue
            if budget.seqs < len(seqs):
                return
            if not self.config.enable_chunked_prefill and longest > budget.tokens:
                return
            # A request that still wants prompt logprobs computes its whole prompt: cached blocks would skip
            # positions it must score (vLLM makes the same choice).
            use_cache = not group.wants_prompt_logprobs
            statuses = [bm.can_allocate(s.token_ids, use_cache, group.cache_salt) for s in seqs]
            if AllocStatus.NEVER in statuses:
                self.waiting.pop(i)
                self._ignore(
                    group,
                    f"the prompt ({longest} tokens) needs more KV blocks than the cache can ever give one request "
                    f"({bm.num_device_blocks} blocks in all, less the free-block watermark)",
                )
                continue
            if AllocStatus.LATER in statuses or not self._allocate_all(seqs, use_cache, group.cache_salt):
                return
            self.waiting.pop(i)
            if group.lora_id != NO_LORA:
                active.add(group.lora_id)
                if held is not None:
                    held.num_lora_bypasses += 1
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            if group.first_scheduled_time is None:
                group.first_scheduled_time = time.monotonic()
                group.num_cached_tokens = seqs[0].num_computed_tokens
            plan = self._plan_tokens(group, budget)
            if plan is not None and self._can_grow(plan):
                self._commit(group, plan, budget, out)

    def _allocate_all(self, seqs: list[Sequence], use_cache: bool, salt: bytes | None) -> bool:
        """Allocate every sequence of a group, or none (a recomputed fork needs one table per sequence)."""
        done: list[Sequence] = []
        for seq in seqs:
            if done and self.block_manager.can_allocate(seq.token_ids, use_cache, salt) is not AllocStatus.OK:
                for d in done:
                    self.block_manager.free(d.seq_id)
                    d.num_computed_tokens = 0
                return False
            seq.num_computed_tokens = self.block_manager.allocate(seq.seq_id, seq.token_ids, use_cache, salt)
            done.append(seq)
        return True

    def _plan_tokens(self, group: SequenceGroup, budget: _Budget) -> list[tuple[Sequence, int]] | None:
        """How many tokens each live sequence runs this step, or None if the budget cannot take the group."""
        plan: list[tuple[Sequence, int]] = []
        tokens_left = budget.tokens
        for seq in group.live_seqs():
            want = seq.num_uncomputed_tokens
            n = min(want, tokens_left)
            if n <= 0 or (n < want and not self.config.enable_chunked_prefill):
                break
            plan.append((seq, n))
            tokens_left -= n
        if not plan or len(plan) > budget.seqs:
            return None
        return plan

    def _can_grow(self, plan: list[tuple[Sequence, int]]) -> bool:
        return self.block_manager.can_append_slots(
            [(seq.seq_id, seq.num_computed_tokens + n, seq.num_computed_tokens) for seq, n in plan]
        )

    def _propose(self, group: SequenceGroup, plan: list[tuple[Sequence, int]], budget: _Budget) -> dict[int, list[int]]:
        """Speculative decoding: seq_id -> proposals for the group's decoding sequences (empty: none).

        Never for a request under a grammar (each proposal's mask would need the matcher advanced through
        the ones before it, on the controller, between scheduling and the step), one about to fork, a pooling
        request, or a row still computing its prompt. Proposals never run past max_tokens or max_model_len
        (the target's own token after them is the last one allowed), nor past the step's token budget."""
        spec = self.config.speculative
        if spec is None or group.pooling_params is not None or group.wants_fork:
            return {}
        params = group.sampling_params
        max_tokens = params.max_tokens if params.max_tokens is not None else self.config.max_model_len
        tokens_left = budget.tokens - sum(n for _, n in plan)
        drafts: dict[int, list[int]] = {}
        for seq, n in plan:
            if n != 1 or seq.num_uncomputed_tokens != 1 or seq.constraint is not None:
                continue
            limit = min(
                tokens_left,
                max_tokens - len(seq.output_token_ids) - 1,
                self.config.max_model_len - seq.num_tokens - 1,
            )
            if limit <= 0:
                continue
            if spec.method == "draft_model":  # rank 0's draft fills them in (model_exec/draft_model.py)
                proposal = [PLACEHOLDER_TOKEN] * min(limit, spec.num_speculative_tokens)
            else:
                proposal = propose_ngram(seq.token_ids, spec, limit)
            if proposal:
                drafts[seq.seq_id] = proposal
                tokens_left -= len(proposal)
        return drafts

    def _can_grow_speculatively(self, plan: list[tuple[Sequence, int]], spec_plan: list[tuple[Sequence, int]]) -> bool:
        """Lookahead slots never cost anyone a preemption: besides fitting, the extra blocks they take must
        leave one free block for every running request (what a decode may need this step)."""
        bm = self.block_manager
        extra = sum(bm.blocks_needed(s.seq_id, s.num_computed_tokens + n) for s, n in spec_plan) - sum(
            bm.blocks_needed(s.seq_id, s.num_computed_tokens + n) for s, n in plan
        )
        return self._can_grow(spec_plan) and bm.num_free_device_blocks - extra >= len(self.running)

    def _commit(
        self,
        group: SequenceGroup,
        plan: list[tuple[Sequence, int]],
        budget: _Budget,
        out: SchedulerOutput,
        drafts: dict[int, list[int]] | None = None,
    ) -> None:
        for seq, n in plan:
            out.blocks_to_copy.extend(
                self.block_manager.append_slots(seq.seq_id, seq.num_computed_tokens + n, seq.num_computed_tokens)
            )
            self._scheduled.append(_Scheduled(group, seq, n, drafts.get(seq.seq_id, []) if drafts else []))
            budget.tokens -= n
            budget.seqs -= 1

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        seqs = group.live_seqs()
        seq_ids = [s.seq_id for s in seqs]
        self.running.remove(group)
        if self._prefers_swap(group) and self.block_manager.can_swap_out(seq_ids):
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(seq_ids))
            status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.swapped.sort(key=lambda g: g.arrival_time)
            self.num_preemptions_swap += 1
        else:
            for seq in seqs:
                self.block_manager.free(seq.seq_id)
                seq.num_computed_tokens = 0
            status = SequenceStatus.WAITING
            self.waiting.insert(0, group)
            if group.wants_prompt_logprobs:
                group.prompt_logprobs = [None]  # collected again from the start
            self.num_preemptions_recompute += 1
        for seq in seqs:
            seq.status = status
            if seq.num_tokens_on_workers:
                self._to_forget.append(seq.seq_id)
            seq.forget_worker_state()

    def _prefers_swap(self, group: SequenceGroup) -> bool:
        mode = self.config.preemption_mode
        if mode != "auto":
            return mode == "swap"
        seqs = group.live_seqs()
        # Recompute throws away one sequence's work cheaply; for several sequences (or one whose
        # recompute would take more than a whole step of budget) copying the blocks out costs less.
        return len(seqs) > 1 or max(s.num_computed_tokens for s in seqs) > self.config.max_num_batched_tokens

    def _fill_seq_data(self, out: SchedulerOutput) -> None:
        """Turn this step's plan into full data for sequences new to the workers, deltas for the rest.
        (Runs for every row every step: attribute lookups hoisted, counts computed once per row.)"""
        bm, bs = self.block_manager, self._block_size
        cached_seqs, num_samples = out.cached_seqs, out.num_samples
        for item in self._scheduled:
            group, seq, n, drafts = item.group, item.seq, item.num_tokens, item.drafts
            seq_id = seq.seq_id
            if drafts:
                out.spec_token_ids[seq_id] = drafts
            table = bm.get_block_table(seq_id)
            computed = seq.num_computed_tokens
            on_workers = seq.num_tokens_on_workers
            num_prompt = len(seq.prompt_token_ids)
            num_tokens = num_prompt + len(seq.output_token_ids)
            if on_workers == 0:
                out.new_seqs.append(
                    NewSeqData(
                        seq_id=seq_id,
                        token_ids=seq.token_ids,
                        num_prompt_tokens=num_prompt,
                        block_ids=table,
                        num_computed_tokens=computed,
                        num_scheduled_tokens=n,
                        sampling_params=group.sampling_params,
                        seed=seq.seed,
                        sample_index=seq.sample_index,
                        lora_id=group.lora_id,
                        pooling_params=group.pooling_params,
                    )
                )
            else:
                sent = seq.block_table_on_workers
                # Only blocks this step writes can have been replaced (copy-on-write) since the workers last
                # saw the table, so the comparison starts at the first of them: O(1) per sequence per step.
                limit = min(len(sent), len(table))
                kept = min(limit, computed // bs)
                while kept < limit and sent[kept] == table[kept]:
                    kept += 1
                new_token_ids = (
                    seq.output_token_ids[on_workers - num_prompt :]
                    if on_workers >= num_prompt
                    else seq.tokens_from(on_workers)
                )
                cached_seqs.append(CachedSeqData(seq_id, new_token_ids, kept, table[kept:], computed, n))
            seq.num_tokens_on_workers = num_tokens
            seq.block_table_on_workers = table
            if computed + n - len(drafts) == num_tokens:
                # best_of samples at the fork (the first sample after the prompt), one afterwards
                num_samples[seq_id] = 1 if group.forked else group.sampling_params.actual_best_of
                if seq.constraint is not None:
                    out.structured_seq_ids.append(seq_id)
            if group.wants_prompt_logprobs and seq is group.seqs[0]:
                out.prompt_logprobs_seq_ids.append(seq_id)

    # ------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[SequenceGroup]:
        """Apply a step's results: advance computed tokens, append samples, fork, stop.

        Returns the requests that got new tokens this step, in batch order. Requests finished for any
        other reason (aborted, ignored) are reported by `take_finished`.
        """
        items = self.take_scheduled()
        self.advance_computed(items)
        return self.apply_result(items, result)

    # The asynchronous step splits `update` in two: `advance_computed` and `add_placeholders` as soon as a step
    # is launched (so the next schedule() plans past it), `apply_result` once its samples arrive.
    def take_scheduled(self) -> list[_Scheduled]:
        """The plan of the last schedule(), handed over (the next schedule() starts a new one)."""
        items, self._scheduled = self._scheduled, []
        return items

    def advance_computed(self, items: list[_Scheduled]) -> None:
        """The step's tokens count as computed (its KV is written before any later step reads it)."""
        for item in items:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted between schedule() and update()
                continue
            before = seq.num_computed_tokens
            # Proposals count once verified (apply_result): their KV is written, but valid only if accepted.
            seq.num_computed_tokens += item.num_tokens - len(item.drafts)
            # Only a block that just became full (and computed) can enter the prefix cache.
            if self._prefix_caching and before // self._block_size != seq.num_computed_tokens // self._block_size:
                self.block_manager.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def add_placeholders(self, items: list[_Scheduled], out: SchedulerOutput) -> None:
        """Give each sequence the launched step samples a placeholder token, so the next schedule() runs its
        decode. A sequence that this sample surely ends by length gets none: it is not scheduled again.
        Only for steps without forks (the caller's rule): one sample per sequence."""
        for item in items:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id not in out.num_samples:
                continue
            assert out.num_samples[seq.seq_id] == 1, "a forking step is never scheduled past"
            params = item.group.sampling_params
            max_tokens = params.max_tokens if params.max_tokens is not None else self.config.max_model_len
            if len(seq.output_token_ids) + 1 >= max_tokens or seq.num_tokens + 1 >= self.config.max_model_len:
                continue
            seq.output_token_ids.append(PLACEHOLDER_TOKEN)

    def apply_result(self, items: list[_Scheduled], result: ModelRunnerOutput) -> list[SequenceGroup]:
        """Append (or put in place of the placeholder) each sample, fork, stop. A sequence that ended since
        the step was scheduled (aborted, or stopped one step late under the asynchronous step) drops it."""
        touched: dict[str, SequenceGroup] = {}
        for seq_id, entries in result.prompt_logprobs.items():
            group = self._seq_owner.get(seq_id)
            if group is not None and group.prompt_logprobs is not None:
                group.prompt_logprobs.extend(entries)
        now = time.monotonic()
        for seq_id, pooled in result.pooled.items():
            group = self._seq_owner.get(seq_id)
            if group is None:  # aborted between schedule() and update()
                continue
            group.pooled = pooled
            group.first_token_time = now
            self.finish_seq(group.seqs[0], SequenceStatus.FINISHED_STOPPED)  # its blocks are free at once
        drafted = {item.seq.seq_id: item.drafts for item in items if item.drafts}
        for seq_id, sample in result.samples.items():
            group = self._seq_owner.get(seq_id)
            if group is None:
                continue
            seqs = group.seqs  # (one sequence but for best_of: no search then)
            parent = seqs[0] if len(seqs) == 1 else next(s for s in seqs if s.seq_id == seq_id)
            if seq_id in drafted:
                if group.first_token_time is None:
                    group.first_token_time = now
                self._apply_verified(group, parent, sample, drafted[seq_id])
                touched[group.request_id] = group
                continue
            targets = [parent]
            if group.wants_fork and len(sample.token_ids) > 1:
                targets += self._fork(group, parent, len(sample.token_ids) - 1)
            if group.first_token_time is None:
                group.first_token_time = now
            self.num_generation_tokens += len(targets)
            for k, seq in enumerate(targets):
                if seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER_TOKEN:
                    seq.output_token_ids[-1] = sample.token_ids[k]
                else:
                    seq.output_token_ids.append(sample.token_ids[k])
                seq.cumulative_logprob += sample.cumulative_logprob_deltas[k]
                if sample.logprobs is not None:
                    seq.output_logprobs.append(sample.logprobs[k])
                self._check_stop(group, seq)
            touched[group.request_id] = group
        return list(touched.values())

    def _apply_verified(self, group: SequenceGroup, seq: Sequence, sample: SeqSample, drafts: list[int]) -> None:
        """A speculative row's answer: its accepted proposals and the target's next token, appended one by one
        (a stop inside the run ends the sequence there; the rest is dropped). Each appended token after the
        first is an accepted proposal's successor, so the proposal's KV, written this step, becomes computed."""
        accepted = len(sample.token_ids) - 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(drafts)
        self.spec_num_accepted_tokens += accepted
        for pos in range(accepted):
            self.spec_accepted_per_pos[pos] += 1
        before = seq.num_computed_tokens
        for j, token in enumerate(sample.token_ids):
            if j:
                seq.num_computed_tokens += 1
            seq.output_token_ids.append(token)
            seq.cumulative_logprob += sample.cumulative_logprob_deltas[j]
            if sample.logprobs is not None:
                seq.output_logprobs.append(sample.logprobs[j])
            self.num_generation_tokens += 1
            self._check_stop(group, seq)
            if seq.is_finished:
                return  # its blocks are free already
        if self._prefix_caching and before // self._block_size != seq.num_computed_tokens // self._block_size:
            self.block_manager.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        self.block_manager.trim(seq.seq_id, seq.num_tokens)  # the rejected proposals' lookahead blocks

    def _fork(self, group: SequenceGroup, parent: Sequence, num_children: int) -> list[Sequence]:
        group.forked = True
        children = []
        for k in range(1, num_children + 1):
            child = Sequence(
                seq_id=self.new_seq_id(),
                prompt_token_ids=parent.prompt_token_ids,
                seed=parent.seed,
                sample_index=k,
                output_token_ids=list(parent.output_token_ids),
                status=SequenceStatus.RUNNING,
                num_computed_tokens=parent.num_computed_tokens,
                cumulative_logprob=parent.cumulative_logprob,
                # Forked before the parent accepts this step's token: every sample drew from the same mask.
                constraint=parent.constraint.fork() if parent.constraint is not None else None,
            )
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self._seq_owner[child.seq_id] = group
            group.seqs.append(child)
            children.append(child)
        return children

    def constraint_of(self, seq_id: int) -> TokenConstraint | None:
        """The grammar matcher of a live sequence (for the controller to fill its token mask)."""
        group = self._seq_owner.get(seq_id)
        seq = next((s for s in group.seqs if s.seq_id == seq_id), None) if group is not None else None
        return seq.constraint if seq is not None else None

    def _check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        params = group.sampling_params
        token = seq.output_token_ids[-1]
        num_out = len(seq.output_token_ids)
        if seq.constraint is not None and not seq.constraint.accept(token):
            # The mask allowed only tokens the grammar accepts, so this is a broken matcher (e.g. a resource
            # limit hit mid-way): end this sample with the reason instead of emitting text that breaks it.
            group.error = f"structured output failed: {seq.constraint.error}"
            self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
            return
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids:
                self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED, stop_reason=token)
                return
            if not params.ignore_eos and token in self.eos_token_ids:
                self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
                return
        if seq.constraint is not None and seq.constraint.is_terminated:
            self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)  # the grammar is complete: nothing may follow
            return
        max_tokens = params.max_tokens if params.max_tokens is not None else self.config.max_model_len
        if num_out >= max_tokens or seq.num_tokens >= self.config.max_model_len:
            self.finish_seq(seq, SequenceStatus.FINISHED_LENGTH_CAPPED)
