"""The scheduler's side of structured outputs, with a fake constraint (no grammar library, no torch):
constrained sampling rows are listed for the controller, every appended token reaches the sample's own
constraint (forks copy it before their first token), a terminated constraint stops the sample, and a
broken one ends it with the reason. Preemption keeps the constraint's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from request.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import SequenceStatus
from tests.scheduler.test_scheduler import add, make, run


@dataclass
class FakeConstraint:
    """Accepts any token but `refuse`; terminates after `length` tokens."""

    length: int
    refuse: int | None = None
    seen: list[int] = field(default_factory=list)
    broken: bool = False

    def accept(self, token_id: int) -> bool:
        if token_id == self.refuse:
            self.broken = True
            return False
        self.seen.append(token_id)
        return True

    def fork(self) -> FakeConstraint:
        return FakeConstraint(self.length, self.refuse, list(self.seen))

    @property
    def is_terminated(self) -> bool:
        return len(self.seen) >= self.length

    @property
    def error(self) -> str | None:
        return f"token {self.refuse} refused" if self.broken else None


def add_constrained(
    sched: Scheduler, rid: str, prompt: list[int], constraint: FakeConstraint, **params: object
) -> None:
    sched.add_request(
        rid, None, prompt, SamplingParams(**{"temperature": 1.0, **params}), seed=1, constraint=constraint
    )  # type: ignore[arg-type]


def test_constrained_rows_are_listed_and_terminated_constraints_stop() -> None:
    sched, worker, bm = make()
    c = FakeConstraint(length=5)
    add_constrained(sched, "c", [5, 6, 7], c, max_tokens=50, ignore_eos=True)
    add(sched, "free", [8, 9], max_tokens=8, ignore_eos=True)
    so = sched.schedule()
    assert so.structured_seq_ids == [so.new_seqs[0].seq_id] and so.new_seqs[0].token_ids == [5, 6, 7]
    sched.update(so, worker.execute(so))
    results = run(sched, worker)
    assert len(results["c"][0]) == 5  # ended by its constraint, long before max_tokens
    assert len(results["free"][0]) == 8
    finished = {g.request_id: g for g in sched.take_finished()}
    assert not finished  # run() took them already
    assert c.seen == results["c"][0]  # every token reached the constraint, in order
    assert bm.num_free_device_blocks == bm.num_device_blocks


def test_forked_samples_each_advance_their_own_copy() -> None:
    sched, worker, _ = make()
    add_constrained(sched, "r", [5, 6, 7], FakeConstraint(length=6), n=3, max_tokens=50, ignore_eos=True)
    group = sched.get_group("r")
    assert group is not None
    run(sched, worker)
    assert len(group.seqs) == 3
    for seq in group.seqs:
        assert seq.status is SequenceStatus.FINISHED_STOPPED
        assert seq.constraint is not None and seq.constraint.seen == seq.output_token_ids  # type: ignore[attr-defined]
    assert len({tuple(s.output_token_ids) for s in group.seqs}) == 3


def test_a_refused_token_ends_the_sample_with_the_reason() -> None:
    sched, worker, bm = make()
    # The fake model is deterministic: probe its first token, then refuse exactly that one.
    add(sched, "probe", [5, 6, 7], max_tokens=1, ignore_eos=True)
    first = run(sched, worker)["probe"][0][0]
    add_constrained(sched, "c", [5, 6, 7], FakeConstraint(length=10, refuse=first), max_tokens=20, ignore_eos=True)
    group = sched.get_group("c")
    assert group is not None
    run(sched, worker)
    assert group.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert group.error == f"structured output failed: token {first} refused"
    assert bm.num_free_device_blocks == bm.num_device_blocks


def test_preemption_keeps_the_constraint_state() -> None:
    """Under a KV pool that forces preemption, each constraint still sees exactly its sample's tokens."""
    for mode in ("recompute", "swap"):
        sched, worker, _ = make(num_blocks=16, preemption_mode=mode)
        constraints = {str(i): FakeConstraint(length=30) for i in range(6)}
        for rid, c in constraints.items():
            add_constrained(sched, rid, [int(rid) + 3] * 9, c, max_tokens=60, ignore_eos=True, temperature=0.0)
        results = run(sched, worker)
        assert sched.num_preemptions_recompute + sched.num_preemptions_swap > 0
        for rid, c in constraints.items():
            assert c.seen == results[rid][0] and len(c.seen) == 30
