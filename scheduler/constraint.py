"""TokenConstraint: what the scheduler needs of a sample's grammar matcher (structured outputs).

The scheduler owns a sequence's tokens, so it advances the sequence's constraint on every token it
appends, forks it with the sequence (`best_of`/`n` samples each continue from the parent's state), and
finishes the sequence (stop) once the constraint is terminated. Building matchers and turning their
states into token masks is the controller's job (cluster/structured_output.py); the scheduler sees only
this protocol, so it stays free of any grammar library.

A constraint lives as long as its `Sequence`: preemption (recompute or swap) keeps it as it is, since
the tokens it has accepted stay the sequence's tokens.
"""

from __future__ import annotations

from typing import Protocol


class TokenConstraint(Protocol):
    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (the matcher is then broken)."""
        ...

    def fork(self) -> TokenConstraint:
        """An independent copy in the same state (for a sibling sample)."""
        ...

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more: the sample ends here."""
        ...

    @property
    def error(self) -> str | None:
        """Why the matcher broke (a token it refused, a resource limit), or None."""
        ...
