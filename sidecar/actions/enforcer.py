"""Escalation for ``kill`` incidents: STOP, then SIGTERM, then SIGKILL, to the right processes.

After STOP went out over the stream, the enforcer waits ``stop_grace``; if the run is still
stepping (no run end, and steps beyond the ones in flight at STOP), every rank's registered
process gets SIGTERM; ``kill_grace`` later, every one still alive gets SIGKILL. Exits are
observed and journaled. The processes an escalation may signal are fixed when it begins: the
ones the kernel named when the ranks of the very incarnation that fired registered (see
``attestation``), journaled with the incident. A rank's process is never replaced; a rank
that joins that same incarnation later (a slow DDP rank) is added from the registry by run
id and incarnation, and journaled too; nothing of another incarnation, and nothing looked
up by run id alone, is ever a target. Before every
signal the pid is opened as a pidfd and its ``/proc`` start time and the boot id are compared
with the recorded ones; the signal then goes through the pidfd, so a pid reused in between can
never receive it. Every step is journaled before it is taken; a restarted sidecar resumes
open escalations from the journal and never repeats a step.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from ..model.finding import Finding, RunSnapshot
from ..model.process import ProcessIdentity, is_alive, reused
from ..store.journal import ActionRow, Store, StoredIncident
from .policy import ActionEvent, Actions

log = structlog.get_logger("deadweight.enforcer")

#: Steps a job that obeys STOP may still report: the step running when STOP arrived, and the
#: next one when STOP lands between that step's hooks. Beyond these it ignored STOP.
STEPS_IN_FLIGHT = 2
#: How long an escalation watches for the exit (after a STOP obeyed, or after SIGKILL).
EXIT_WATCH_SECONDS = 30.0


class RunSource(Protocol):
    """What the enforcer reads from (and tells) the registry."""

    def progress(self, run_id: str, incarnation: int
                 ) -> tuple[int, bool, frozenset[int]] | None:
        """(step, ended, ranks) of one incarnation of a run; None once the registry forgot
        it or the run id lives in another incarnation."""
        ...

    def mark_ended(self, run_id: str, reason: str, incarnation: int) -> None: ...

    def identities(self, run_id: str, incarnation: int | None = None
                   ) -> dict[int, ProcessIdentity]:
        """rank -> process bound to that incarnation of the run ({} for another one)."""
        ...


def send_signal(identity: ProcessIdentity, signum: int, dry_run: bool = False) -> str:
    """Signal identity's process if, and only if, it is still that process; the result."""
    if identity.pid <= 1 or identity.pid == os.getpid():
        return "refused"
    try:
        pidfd = os.pidfd_open(identity.pid)
    except ProcessLookupError:
        return "gone"
    except OSError as err:
        return f"failed:{err.errno}"
    try:
        # The pidfd pins the process that held the pid at open time; the start time read
        # after it proves that process is the identified one.
        if not is_alive(identity):
            return "pid_reused" if reused(identity) else "gone"
        if dry_run:
            return "dry_run"
        signal.pidfd_send_signal(pidfd, signum)
        return "sent"
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "permission_denied"
    finally:
        os.close(pidfd)


@dataclass
class Target:
    """One rank's process in an escalation."""

    rank: int
    identity: ProcessIdentity | None
    signalled: str = ""  # the last signal journaled: "", "sigterm", "sigkill"
    finished: bool = False  # exited, or never signalable


@dataclass
class Escalation:
    run_id: str
    trainer: str
    detector: str
    incident: int
    evidence: dict[str, str]
    stop_at: float
    stop_step: int
    term_at: float | None = None
    kill_at: float | None = None
    delivered: int = 0  # signals that reached a process
    targets: dict[int, Target] = field(default_factory=dict)
    incarnation: int = 1

    def event(self, action: str, result: str, target: Target | None = None,
              **detail: object) -> ActionEvent:
        return ActionEvent(
            self.run_id, self.trainer, self.detector, self.incident, action, result,
            rank=None if target is None else target.rank,
            pid=None if target is None or target.identity is None else target.identity.pid,
            evidence=self.evidence, detail=dict(detail), incarnation=self.incarnation,
        )


class Enforcer:
    """Drives every open ``kill`` escalation from one background thread."""

    def __init__(
        self,
        runs: RunSource,
        store: Store,
        actions: Actions,
        stop_grace_seconds: float = 120.0,
        kill_grace_seconds: float = 30.0,
        poll_seconds: float = 0.1,
    ) -> None:
        self.runs = runs
        self.store = store
        self.actions = actions
        self.stop_grace = stop_grace_seconds
        self.kill_grace = kill_grace_seconds
        self.poll_seconds = poll_seconds
        self._lock = threading.Lock()
        #: (run id, detector, incident): an incident number belongs to one incarnation.
        self._open: dict[tuple[str, str, int], Escalation] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def dry_run(self) -> bool:
        return self.actions.dry_run

    # -- entry points ----------------------------------------------------------------------

    def begin(self, run: RunSnapshot, finding: Finding, stop_at: float, stop_step: int
              ) -> None:
        """Called once STOP went out for a ``kill`` incident; run is the incarnation as it
        was when the verdict fired, with the processes bound to it then: the only ones this
        escalation will ever signal (journaled first, so a restart signals no other)."""
        esc = Escalation(run.run_id, run.trainer, finding.detector, finding.incidents,
                         dict(finding.evidence), stop_at, stop_step,
                         incarnation=run.incarnation)
        for rank, identity in run.processes:
            esc.targets[rank] = Target(rank, identity)
        self.store.set_targets(esc.run_id, esc.detector, esc.incident,
                               dict(run.processes), esc.incarnation)
        with self._lock:
            self._open[(esc.run_id, esc.detector, esc.incident)] = esc
        log.info("escalation_started", run_id=esc.run_id, detector=esc.detector,
                 incident=esc.incident, stop_grace_seconds=self.stop_grace,
                 kill_grace_seconds=self.kill_grace)

    def resume(self) -> int:
        """Re-open the escalations a previous sidecar left unfinished, from the journal."""
        resumed = 0
        for incident in self.store.open_enforcements():
            esc = self._from_journal(incident)
            with self._lock:
                self._open[(esc.run_id, esc.detector, esc.incident)] = esc
            resumed += 1
            log.info("escalation_resumed", run_id=esc.run_id, detector=esc.detector,
                     incident=esc.incident, term_sent=esc.term_at is not None,
                     kill_sent=esc.kill_at is not None)
        return resumed

    def _from_journal(self, incident: StoredIncident) -> Escalation:
        rows = self.store.actions(incident.run_id, incident.detector, incident.incident)
        stops = [r for r in rows if r.action == "stop" and r.result in ("sent", "dry_run")]
        stop = stops[0] if stops else None
        trainer = rows[0].trainer if rows else ""
        esc = Escalation(
            incident.run_id, trainer, incident.detector, incident.incident,
            incident.evidence, stop.time if stop else incident.fired_at,
            int(stop.detail.get("step", incident.step)) if stop else incident.step,
            incarnation=incident.incarnation,
        )
        for rank, identity in incident.targets.items():  # fixed when it began
            esc.targets[rank] = Target(rank, identity)
        for row in rows:
            self._replay(esc, row)
        return esc

    @staticmethod
    def _replay(esc: Escalation, row: ActionRow) -> None:
        if row.rank is None:
            return
        target = esc.targets.setdefault(row.rank, Target(row.rank, None))
        if row.action in ("sigterm", "sigkill"):
            # A pending row means the sidecar died around the signal: it counts as sent.
            target.signalled = row.action
            if row.result in ("sent", "pending"):
                esc.delivered += 1
            if row.action == "sigterm":
                esc.term_at = min(esc.term_at or row.time, row.time)
            else:
                esc.kill_at = min(esc.kill_at or row.time, row.time)
            if row.result not in ("sent", "pending", "dry_run"):
                target.finished = True
        elif row.action == "exit":
            target.finished = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="deadweight-enforcer",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def open_escalations(self) -> list[tuple[str, str, int]]:
        with self._lock:
            return sorted(self._open)

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll()
            except Exception:  # one bad escalation must not end enforcement
                log.exception("enforcer_poll_failed")

    def poll(self, now: float | None = None) -> None:
        """Advance every open escalation as far as time and the run's state allow."""
        with self._lock:
            escalations = list(self._open.values())
        for esc in escalations:
            outcome = self._advance(esc, time.time() if now is None else now)
            if outcome:
                with self._lock:
                    self._open.pop((esc.run_id, esc.detector, esc.incident), None)
                self.store.close_enforcement(esc.run_id, esc.detector, esc.incident, outcome,
                                             esc.incarnation)
                log.info("escalation_closed", run_id=esc.run_id, detector=esc.detector,
                         incident=esc.incident, outcome=outcome)

    def _note_ranks(self, esc: Escalation, ranks: frozenset[int]) -> None:
        """Ranks of the same incarnation the escalation does not know yet: added with the
        process bound to that incarnation (journaled), or as never signalable
        (``no_identity``). A rank already known keeps its process."""
        new = ranks - set(esc.targets)
        if not new:
            return
        bound = self.runs.identities(esc.run_id, esc.incarnation)
        for rank in sorted(new):
            esc.targets[rank] = Target(rank, bound.get(rank))
        self.store.set_targets(esc.run_id, esc.detector, esc.incident,
                               {r: t.identity for r, t in esc.targets.items()
                                if t.identity is not None}, esc.incarnation)

    def supersede(self, run_id: str, incarnation: int) -> None:
        """An incarnation of the run id closed: its open escalations end, unsignalled."""
        with self._lock:
            closing = [key for key, esc in self._open.items()
                       if key[0] == run_id and esc.incarnation == incarnation]
            for key in closing:
                del self._open[key]
        for _, detector, incident in closing:
            self.store.close_enforcement(run_id, detector, incident, "superseded",
                                         incarnation)
            log.warning("escalation_closed", run_id=run_id, detector=detector,
                        incident=incident, outcome="superseded")

    def _observe_exits(self, esc: Escalation, now: float) -> None:
        for target in esc.targets.values():
            if target.finished or target.identity is None:
                continue
            if not is_alive(target.identity):
                target.finished = True
                # Another process holding the pid means ours is gone all the same.
                result = "pid_reused" if reused(target.identity) else "exited"
                self.actions.record(esc.event(
                    "exit", result, target, after=target.signalled or "stop",
                    seconds_after_stop=round(now - esc.stop_at, 3)))

    def _advance(self, esc: Escalation, now: float) -> str:
        """One look at an escalation; returns its outcome once it is over, else ''."""
        progress = self.runs.progress(esc.run_id, esc.incarnation)
        step, ended, ranks = progress if progress is not None else (0, True, frozenset())
        self._note_ranks(esc, ranks)
        self._observe_exits(esc, now)
        identified = [t for t in esc.targets.values() if t.identity is not None]
        live = [t for t in identified if not t.finished]
        if esc.term_at is None:
            if identified and not live:
                return "exited"  # every registered process left after STOP
            if now < esc.stop_at + self.stop_grace:
                return ""
            if ended:  # the job obeyed STOP; watch its processes leave for a while
                if now >= esc.stop_at + self.stop_grace + EXIT_WATCH_SECONDS:
                    return "stopped"
                return ""
            if step <= esc.stop_step + STEPS_IN_FLIGHT:
                return ""  # not stepping since STOP (a long step, or hung): not ours to end
            esc.term_at = now
            self._signal_all(esc, "sigterm", signal.SIGTERM, step=step)
            return ""
        if esc.kill_at is None:
            if not live:
                return self._finish(esc, "terminated")
            if now < esc.term_at + self.kill_grace:
                return ""
            esc.kill_at = now
            self._signal_all(esc, "sigkill", signal.SIGKILL)
            return ""
        if not live or self.dry_run:
            return self._finish(esc, "killed")
        if now >= esc.kill_at + EXIT_WATCH_SECONDS:
            return "survived_sigkill"
        return ""

    def _signal_all(self, esc: Escalation, action: str, signum: int, **detail: object) -> None:
        for target in sorted(esc.targets.values(), key=lambda t: t.rank):
            if target.finished:
                continue
            if target.identity is None:
                # Registered without a kernel identity (TCP, or no attestation): never signal.
                target.finished = True
                self.actions.record(esc.event(action, "no_identity", target, **detail))
                continue
            action_id = self.actions.intend(esc.event(action, "pending", target, **detail))
            result = send_signal(target.identity, signum, dry_run=self.dry_run)
            target.signalled = action
            if result == "sent":
                esc.delivered += 1
            elif result != "dry_run":
                target.finished = True
            if result == "permission_denied":
                # The kernel refused (EPERM): another uid, and no CAP_KILL. The run goes on;
                # journaled and counted like every result, and said plainly here.
                log.error("signal_permission_denied", run_id=esc.run_id, rank=target.rank,
                          pid=target.identity.pid, target_uid=target.identity.uid,
                          signal=action, sidecar_uid=os.geteuid(),
                          note="the sidecar runs as another uid than the trainer and lacks "
                          "CAP_KILL: add the KILL capability, or run both as one uid")
            self.actions.settle(action_id, esc.event(
                action, result, target, start_time=target.identity.start_time, **detail))

    def _finish(self, esc: Escalation, outcome: str) -> str:
        """The escalation's outcome; a run whose processes we ended is ended."""
        if self.dry_run:
            return "dry_run"
        if esc.delivered == 0:
            return "nothing_signalled"
        self.runs.mark_ended(esc.run_id, outcome, esc.incarnation)
        return outcome
