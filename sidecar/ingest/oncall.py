"""On-call's hands on a running sidecar: stop one run, silence one detector on one run.

Both arrive as RPCs (``Stop``, ``Silence``) on the unix socket and are allowed only to the
operators, as the kernel names the caller: root, the ``--operator-uid`` uids, and the
sidecar's own uid when no training job runs as it (on-call powers must not come with being a
trainer: a job that may report runs may not stop another). The command fetches a nonce from
the attestation socket (``SO_PEERCRED``) and sends it with the request; a nonce is redeemed
once, so nothing in a message can claim a uid. Every command is journaled like a verdict's
action: STOP under the detector ``operator`` (once per incarnation of a run: a second
``deadweight stop`` answers that STOP already went out; a restarted sidecar sends it again
to that incarnation, never to another), a silence as ``silence``/``set`` and, at its end,
``silence``/``expired``. ``SilenceClock`` ends silences on time and pages what still fires.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterable

import structlog

from ...proto import pb
from ..actions.policy import ActionEvent, Actions, operator_stop_directive
from ..actions.silences import (
    ACTION,
    MAX_SILENCE_SECONDS,
    Silence,
    Silences,
)
from ..detectors import BY_ID
from ..model.finding import OPERATOR
from ..model.nonces import Attestor
from ..model.process import ProcessIdentity
from ..registry import Registry
from ..store.journal import StoreWriteFailed

log = structlog.get_logger("deadweight.oncall")

#: Longest reason kept (journal, console line, status).
MAX_REASON_CHARS = 512
#: How often the clock looks for silences whose time is up.
CLOCK_SECONDS = 0.25


class Refused(Exception):
    """The caller may not do this (or the request is malformed); the message says why."""

    def __init__(self, message: str, permission: bool = False) -> None:
        super().__init__(message)
        #: True: who is asking is the problem (PERMISSION_DENIED), not what (INVALID_ARGUMENT).
        self.permission = permission


def operator_uids(trainer_uids: Iterable[int] = (), extra: Iterable[int] = ()
                  ) -> frozenset[int]:
    """Who may stop and silence: root, the uids named with ``--operator-uid``, and the
    sidecar's own uid unless it is a trainer uid (in a set-up where jobs run as the sidecar's
    uid, any job could otherwise stop every other run)."""
    own = os.geteuid()
    return frozenset({0, *extra} | ({own} if own not in set(trainer_uids) else set()))


class Oncall:
    """Carries out ``Stop`` and ``Silence`` for an attested caller."""

    def __init__(self, registry: Registry, actions: Actions, attestor: Attestor | None,
                 allowed_uids: Iterable[int] | None = None) -> None:
        self.registry = registry
        self.actions = actions
        self.attestor = attestor
        self.allowed_uids = frozenset(operator_uids() if allowed_uids is None
                                      else allowed_uids)
        self._lock = threading.Lock()  # one command at a time: exactly-once checks hold

    @property
    def silences(self) -> Silences:
        return self.actions.silences

    def caller(self, nonce: str, over_unix: bool) -> ProcessIdentity:
        """The kernel's identity of the caller; Refused unless it is an operator uid."""
        if not over_unix:
            raise Refused("stop and silence are allowed over the unix socket only (the "
                          "caller's uid must come from the kernel)", permission=True)
        identity = self.attestor.redeem(nonce) if self.attestor is not None else None
        if identity is None:
            raise Refused("no valid attestation: run the command on the sidecar's host as "
                          "an operator uid (root, or serve --operator-uid)", permission=True)
        if identity.uid not in self.allowed_uids:
            raise Refused(f"uid {identity.uid} may not stop or silence runs (only uids "
                          f"{sorted(self.allowed_uids)}): training jobs run as a trainer uid, "
                          "and on-call powers do not come with it; run the command as root, "
                          "or give on-call its own uid (serve --operator-uid)",
                          permission=True)
        return identity

    def stop(self, request: pb.StopRequest, caller: ProcessIdentity) -> pb.StopResponse:
        """Journal the STOP, then queue it for every rank of the run's live incarnation.

        Journaled first, with the incarnation: a sidecar that dies before the run's stream
        picked it up queues it again when it comes back (``Actions.resumed_operator_stop``),
        for that incarnation only; a caller told "queued" can rely on that."""
        reason = (request.reason or "stopped by hand").strip()[:MAX_REASON_CHARS]
        with self._lock:
            state = self.registry.run(request.run_id)
            if state is None:
                raise Refused(f"unknown run {request.run_id!r}")
            if state.ended:
                raise Refused(f"run {request.run_id!r} has ended; nothing to stop")
            done = self.actions.operator_stop(state)
            if done is not None:
                return pb.StopResponse(already=True, step=int(done.detail.get("step", 0)),
                                       message=f"STOP already went out for {request.run_id}")
            event = ActionEvent(
                state.run_id, state.trainer, OPERATOR, state.incarnation, "stop", "sent",
                detail={"step": state.step, "reason": reason, "by_uid": caller.uid,
                        "by_pid": caller.pid}, incarnation=state.incarnation)
            try:
                self.actions.record(event)
            except StoreWriteFailed as err:
                raise Refused(f"STOP not sent: the journal cannot be written ({err})") from None
            run = self.registry.direct(request.run_id, operator_stop_directive(reason),
                                       incarnation=state.incarnation)
            if run is None:  # it ended (or a new incarnation began) since the look above
                self.actions.record(dataclasses.replace(event, result="run_ended"))
                raise Refused(f"run {request.run_id!r} has ended; nothing to stop")
        return pb.StopResponse(step=run.step, message=(
            f"STOP queued for {run.run_id} at step {run.step}: every rank gets it with its "
            "next acknowledgement and ends training after the current step (journaled: a "
            "sidecar restart sends it again)"))

    def silence(self, request: pb.SilenceRequest, caller: ProcessIdentity
                ) -> pb.SilenceResponse:
        if request.detector not in BY_ID:
            raise Refused(f"unknown detector {request.detector!r}")
        if not 0 < request.seconds <= MAX_SILENCE_SECONDS:
            raise Refused(f"a silence lasts more than 0 and at most {MAX_SILENCE_SECONDS:.0f}s")
        if not request.run_id:
            raise Refused("a silence names one run")
        reason = request.reason.strip()[:MAX_REASON_CHARS]
        until = time.time() + request.seconds
        with self._lock:
            found = self.registry.finding_of(request.run_id, request.detector)
            trainer = found[0].trainer if found is not None else ""
            replaced = self.silences.set(Silence(request.run_id, request.detector, until,
                                                 reason))
            life = found[0].incarnation if found is not None else 1
            if replaced is not None:
                self._journal(replaced, trainer, "replaced", life)
            self.actions.record(ActionEvent(
                request.run_id, trainer, request.detector, 0, ACTION, "set",
                detail={"until": until, "seconds": request.seconds, "reason": reason,
                        "by_uid": caller.uid, "by_pid": caller.pid}, incarnation=life))
        if found is not None:
            run, finding = found
            if finding is not None and finding.firing:
                self.actions.muting(run, request.detector, until, reason)
                self.actions.silenced(run, finding)
                # The symptoms it inhibits stay quiet with it (a silenced cause still
                # inhibits them): their pages out resolve too.
                for symptom in self.actions.symptoms(run, request.detector):
                    self.actions.silenced(run, symptom)
        return pb.SilenceResponse(until=until, message=(
            f"{request.detector} silenced on {request.run_id} for {request.seconds:g}s: it "
            "does not page until then, and pages then if it still fires"))

    def expire(self, now: float | None = None) -> int:
        """End the silences whose time is up; page what still fires. Returns how many."""
        ended = self.silences.expired(now)
        for silence in ended:
            found = self.registry.finding_of(silence.run_id, silence.detector)
            self._journal(silence, found[0].trainer if found else "", "expired",
                          found[0].incarnation if found else 1)
            run, finding = found if found is not None else (None, None)
            if run is None or finding is None or not finding.firing:
                self.actions.unmuting(silence.run_id, silence.detector)
                continue
            self.actions.unsilenced(run, finding)
            # Its symptoms are as they would be without the silence: paged beside it (the
            # cause inhibits them again in Alertmanager), unless held by another silence.
            for symptom in self.actions.symptoms(run, silence.detector):
                if not self.actions.silenced_by(run, symptom.detector):
                    self.actions.unsilenced(run, symptom)
            self.actions.unmuting(silence.run_id, silence.detector)  # after the pages again
        return len(ended)

    def _journal(self, silence: Silence, trainer: str, result: str, life: int) -> None:
        """A silence's change, journaled on the run id's life it applies to now."""
        self.actions.record(ActionEvent(silence.run_id, trainer, silence.detector, 0, ACTION,
                                        result, detail={"until": silence.until,
                                                        "reason": silence.reason},
                                        incarnation=life))


class SilenceClock:
    """A thread that ends silences on time (``Oncall.expire``)."""

    def __init__(self, oncall: Oncall, interval: float = CLOCK_SECONDS) -> None:
        self.oncall = oncall
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deadweight-silences",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.oncall.expire()
            except Exception:  # a failed journal write: tried again at the next turn
                log.exception("silence_expiry_failed")
