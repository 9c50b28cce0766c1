"""Property: a healthy job is never signalled, stopped or paged for another job's verdict.

Two real live processes (same uid) report with ONE run id and one rank: A is frozen, B
learns. Hypothesis draws the interleaving: each job's batches, re-sends of a batch verbatim,
reconnects (a new stream whose RunStart carries a fresh nonce of the same process), run ends
and sidecar restarts (a new registry, actions and enforcer on the same journal, resumed).
The real registry, actions (policy kill, a recording pager) and enforcer (dry run: every
check, no signal) judge. After every step:

- B's streams never receive a directive, no journaled action names B's pid, and no
  escalation ever has B's process as a target;
- every action is journaled on an incarnation whose rank 0 is bound to A;
- the run id changes hands only after its owner ended its run (no turn-taking);
- a refused job is told why (``in use by another live process``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from deadweight.proto import pb
from deadweight.sidecar.actions.enforcer import Enforcer
from deadweight.sidecar.actions.policy import Actions
from deadweight.sidecar.detectors.base import Policy
from deadweight.sidecar.ingest.attestation import Attestor, ProcessIdentity, boot_id, start_time
from deadweight.sidecar.model.finding import Finding, RunSnapshot
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Peer, Registry
from deadweight.sidecar.store.journal import Store
from tests.support.raw_client import frozen_events, healthy_events
from tests.unit.test_fuzz_registry import FUZZ

RUN = "one-id-two-jobs"
UNIX = "unix:"


@pytest.fixture(autouse=True, scope="module")
def _quiet() -> Iterator[None]:
    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    yield
    structlog.configure(**old)


def _identity(process: subprocess.Popen[bytes]) -> ProcessIdentity:
    started = start_time(process.pid)
    assert started is not None
    return ProcessIdentity(process.pid, os.getuid(), os.getgid(), started, boot_id())


@pytest.fixture(scope="module")
def jobs() -> Iterator[tuple[ProcessIdentity, ProcessIdentity]]:
    """The two live processes the kernel would name (A frozen, B learning)."""
    a, b = subprocess.Popen(["sleep", "600"]), subprocess.Popen(["sleep", "600"])
    try:
        yield _identity(a), _identity(b)
    finally:
        for process in (a, b):
            process.kill()
            process.wait()


class Pager:
    def __init__(self) -> None:
        self.pages: list[tuple[str, str]] = []

    def fire(self, run_id: str, detector: str, severity: str, summary: str, description: str,
             evidence: dict[str, str], starts_at: float | None = None) -> None:
        self.pages.append((run_id, detector))

    def resolve(self, run_id: str, detector: str, severity: str) -> None:
        return None


@dataclass
class Job:
    identity: ProcessIdentity
    frozen: bool
    peer: Peer | None = None
    seq: int = 0
    step: int = 0
    last: pb.StreamRequest | None = None
    directives: list[pb.Directive] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


class Sidecar:
    """Registry, actions and enforcer on one journal; ``restart`` builds them again."""

    def __init__(self, store: Store, attestor: Attestor) -> None:
        self.store, self.attestor = store, attestor
        self.targets: list[RunSnapshot] = []
        self.pager = Pager()
        self.build()

    def build(self) -> None:
        def escalate(run: RunSnapshot, finding: Finding, at: float, step: int) -> None:
            self.targets.append(run)
            self.enforcer.begin(run, finding, at, step)

        def supersede(run_id: str, incarnation: int) -> None:
            self.enforcer.supersede(run_id, incarnation)

        actions = Actions(pager=self.pager, dry_run=True, store=self.store,
                          escalate=escalate, supersede=supersede)
        self.registry = Registry(actions, settings=DetectorSettings(frozen_steps=2),
                                 policies={"frozen_weights": Policy.KILL}, store=self.store,
                                 attestor=self.attestor)
        self.enforcer = Enforcer(self.registry, self.store, actions, stop_grace_seconds=0.0,
                                 kill_grace_seconds=0.0)
        self.registry.resume()
        self.enforcer.resume()


def _start(sidecar: Sidecar, job: Job) -> pb.Event:
    membership = pb.OptimizerMembership(optimizer_tensors=4, optimizer_params=1000,
                                        trainable_tensors=4, trainable_params=1000,
                                        adapter_params=1000, adapter_tensors=4)
    return pb.Event(seq=0, run_start=pb.RunStart(
        trainer="SFTTrainer", world_size=1, config={"learning_rate": 1e-4},
        attestation=sidecar.attestor.issue(job.identity), membership=membership))


def _send(sidecar: Sidecar, job: Job, request: pb.StreamRequest) -> None:
    assert job.peer is not None
    job.last = request
    response = sidecar.registry.ingest(request, job.peer)
    job.directives.extend(response.directives)
    if response.error:
        job.refusals.append(response.error)
    if job.peer.rejected:  # the server would end this stream: the client reconnects
        job.peer = None


OPS = st.lists(st.tuples(st.sampled_from(["send", "send", "send", "resend", "reconnect",
                                          "end", "restart", "tick"]),
                         st.sampled_from([0, 1])), min_size=1, max_size=40)


@settings(FUZZ, max_examples=300)
@given(ops=OPS)
def test_a_healthy_job_is_never_touched_for_another_jobs_verdict(
    jobs: tuple[ProcessIdentity, ProcessIdentity], ops: list[tuple[str, int]],
) -> None:
    frozen_id, healthy_id = jobs
    store = Store()
    sidecar = Sidecar(store, Attestor())
    a, b = Job(frozen_id, frozen=True), Job(healthy_id, frozen=False)
    ends = 0
    for op, who in ops:
        job = (a, b)[who]
        if op == "restart":
            sidecar.build()
            a.peer = b.peer = None
        elif op == "tick":
            sidecar.registry.tick()
            sidecar.enforcer.poll(time.time() + 1000.0)
        elif op == "resend" and job.peer is not None and job.last is not None:
            _send(sidecar, job, job.last)
        elif op == "end" and job.peer is not None:
            job.seq += 1
            owner = sidecar.registry.identities(RUN).get(0)
            _send(sidecar, job, pb.StreamRequest(run_id=RUN, events=[
                pb.Event(seq=job.seq, run_end=pb.RunEnd(reason="completed"))]))
            ends += owner == job.identity
        elif op in ("send", "reconnect", "resend", "end"):
            events: list[pb.Event] = []
            if job.peer is None or op == "reconnect":
                job.peer = Peer(address=UNIX)
                events.append(_start(sidecar, job))
            job.step += 1
            events += (frozen_events if job.frozen else healthy_events)(job.step, job.seq + 1)
            job.seq += 2
            _send(sidecar, job, pb.StreamRequest(run_id=RUN, events=events))

        # -- what must hold after every step of every interleaving --------------------------
        assert b.directives == [], b.directives
        rows = store.actions(RUN)
        assert all(row.pid in (None, frozen_id.pid) for row in rows), rows
        for row in rows:
            assert store.bindings(RUN, row.incarnation).get(0) == frozen_id, row
        assert all(dict(s.processes).get(0) == frozen_id for s in sidecar.targets)
        assert all(t.identity in (None, frozen_id)
                   for _, esc in list(sidecar.enforcer._open.items())
                   for t in esc.targets.values())
        assert sidecar.registry.incarnations_started <= ends, (ends, ops)
        for refusal in a.refusals + b.refusals:
            assert ("in use by another live process" in refusal or "incarnation" in refusal
                    or "send run_start first" in refusal), refusal
    if any(op == "send" for op, _ in ops):
        assert store.actions(RUN) or not sidecar.pager.pages  # pages are journaled
