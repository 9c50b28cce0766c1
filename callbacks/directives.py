"""The sidecar's directives, applied one way for every driver (Trainer, ``watch``, Lightning).

A STOP is said once on the console, root cause first, and leaves the mark a script reads
(``stopped_by``); on a run of one rank the loop leaves at once, on a multi-rank run this rank
only proposes and every rank leaves after the same step (``StopAgreement``). An ABORT is said
the same way and raises ``DeadweightAbort`` into the training loop, at this look and every
later one. What a driver keeps is the act only its framework knows: the Trainer's
``control.should_training_stop``, ``monitor.should_stop``, Lightning's ``trainer.should_stop``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..proto import pb
from .run_probe import DeadweightAbort, RunProbe
from .stop_agreement import StopAgreement

#: Added to the driver's words for a STOP when every rank must leave after the same step.
EVERY_RANK = " on every rank at the same step"


@dataclass(frozen=True)
class Stopped:
    """The first STOP of the run, as a driver acts on it."""

    #: The root cause and the reason (what ``stopped_by_deadweight`` holds).
    mark: str
    #: The root cause's detector id.
    root: str
    #: Leave the loop now (one rank); else ``Directives.step_end`` says when, on every rank.
    now: bool


class Directives:
    """What the sidecar decided for one run on one rank, applied at each look of a driver."""

    def __init__(self, run: RunProbe, how: str) -> None:
        """how: what the driver does on a STOP, in the console's words ("stopping training")."""
        self._run = run
        self._how = how
        self.agreement: StopAgreement | None = None
        #: Why deadweight stopped this run (its root cause first), None unless it did.
        self.stopped_by: str | None = None
        self._proposed = False
        self._abort: str | None = None

    def agree(self) -> None:
        """Set up the stop agreement of a multi-rank run. Collective: every rank calls it
        at train begin, outside any shield."""
        self.agreement = StopAgreement.create()

    def look(self) -> Stopped | None:
        """Apply what the sidecar sent since the last look (its verdict lines go out first).

        Returns the run's first STOP, once; raises ``DeadweightAbort`` after an ABORT."""
        if self._abort is not None:
            raise DeadweightAbort(self._abort)
        first: Stopped | None = None
        for directive in self._run.directives():
            if directive.action == pb.Directive.ACTION_STOP:
                if self.agreement is not None:  # ranks see it a step apart: agree on one
                    self._proposed = True
                if self.stopped_by is None:
                    first = self._stop(directive)
            elif directive.action == pb.Directive.ACTION_ABORT:
                self._abort = ("deadweight aborted training, root cause "
                               f"{self._run.aborted(directive)}")
                raise DeadweightAbort(self._abort)
        return first

    def _stop(self, directive: pb.Directive) -> Stopped:
        how = self._how + (EVERY_RANK if self.agreement is not None else "")
        self.stopped_by = self._run.stopped(directive, how)
        console = self._run.console
        root = console.stop_root if console is not None else None
        return Stopped(self.stopped_by, root or directive.detector, now=self.agreement is None)

    def step_end(self) -> bool:
        """At every step end, on every rank: True when the ranks agreed to leave now."""
        return self.agreement is not None and self.agreement.step_end(self._proposed)

    def close(self) -> None:
        """Finish the agreement's last collective (every rank, at train end)."""
        if self.agreement is not None:
            self.agreement.close()
