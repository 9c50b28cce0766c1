"""The composition root: one place that builds a running sidecar from its configuration.

``build`` makes the parts in dependency order (store, pager, actions, registry, enforcer)
from a ``SidecarConfig``; ``Sidecar`` adds what serves them (checkpoint watcher, collector,
``/metrics``, attestation socket, gRPC) and starts and stops everything together. The one
cycle, actions -> enforcer -> registry -> actions, is cut by handing the actions a callable
that reaches the enforcer; nothing is wired in after construction. ``cli serve`` parses flags
into a ``SidecarConfig`` and calls ``build``; tests that need their own registry give it to
``Sidecar`` directly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from ..proto.transport import attest_path
from .actions.alertmanager import AlertmanagerPusher
from .actions.enforcer import Enforcer
from .actions.links import (
    DEFAULT_DASHBOARD_URL_PATTERN,
    DEFAULT_RUNBOOK_URL_PATTERN,
    runbook_pattern_for,
)
from .actions.pagers import PagerSet, PagerTarget
from .actions.policy import Actions
from .actions.webhook import WebhookNotifier
from .checkpoints.watcher import CheckpointWatcher
from .detectors.base import Policy
from .exposition.collector import DeadweightCollector
from .exposition.http import MetricsServer
from .ingest.attestation import AttestationServer
from .ingest.oncall import Oncall, SilenceClock, operator_uids
from .ingest.server import ServerConfig, SidecarServer, check_transport
from .ingest.socket_claim import refuse_if_listening
from .model.finding import Finding, RunSnapshot
from .model.nonces import Attestor
from .model.settings import DetectorSettings
from .registry import Registry
from .store.history_queue import HistoryQueue
from .store.journal import Store
from .store.lock import StateDirLock

log = structlog.get_logger("deadweight.app")

if TYPE_CHECKING:
    from .store.signing_key import SummarySigner


@dataclass
class SidecarConfig:
    """Everything ``deadweight serve`` is told (files already read)."""

    server: ServerConfig = field(default_factory=ServerConfig)
    state_dir: str | None = None
    alertmanager_url: str | None = None
    #: Chat or incident webhooks paged directly, one JSON message per incident.
    webhook_urls: tuple[str, ...] = ()
    #: The pager outbox's clocks: one attempt's deadline, the retry backoff, and how often
    #: firing alerts are re-asserted to Alertmanager.
    pager_deadline: float = 10.0
    pager_backoff: float = 0.5
    pager_backoff_max: float = 30.0
    pager_resend_interval: float = 60.0
    #: None: this sidecar's own /runbooks/ on the address /metrics is served at (its real
    #: port once bound), so the link follows ``--metrics-address``.
    runbook_url_pattern: str | None = None
    dashboard_url_pattern: str = DEFAULT_DASHBOARD_URL_PATTERN
    dry_run: bool = False
    policies: dict[str, Policy] = field(default_factory=dict)
    settings: DetectorSettings = field(default_factory=DetectorSettings)
    max_runs: int = 1000
    max_runs_per_process: int = 64
    max_runs_per_uid: int = 256
    #: A live run that never stepped this long after registering may give up its slot.
    reclaim_unstepped_seconds: float = 600.0
    #: Ranks held across all runs (``--max-ranks``).
    max_ranks: int = 4096
    run_ttl_seconds: float = 900.0
    stop_grace_seconds: float = 120.0
    kill_grace_seconds: float = 30.0
    #: Let unattested streams on the unix socket register runs (logged, exported).
    allow_unattested: bool = False
    #: A live run that sends nothing this long ends as "silent".
    silent_run_seconds: float = 3600.0
    #: Only attested processes of these uids may report (empty: any uid).
    trainer_uids: tuple[int, ...] = ()


def key_within_trainers_reach(trainer_uids: frozenset[int]) -> bool:
    """True when training jobs of the sidecar's own uid may report (no trainer uid named,
    which admits any, or the sidecar's uid among them): such a job can read the signing key
    (the state dir's file, or this process's memory) and sign a passing summary itself."""
    return not trainer_uids or os.geteuid() in trainer_uids


def signing_key_warning(signer: SummarySigner, trainer_uids: frozenset[int]) -> str:
    """The sentence the start log and ``deadweight status`` carry for that set-up."""
    uid = os.geteuid()
    named = ", ".join(str(u) for u in sorted(trainer_uids)) or "any"
    return (f"trainers of this uid can read the signing key: training jobs of uid {uid} "
            f"(the sidecar's own; trainer uids: {named}) may report here, and any of them can "
            f"read the key (key id {signer.key_id}) and sign a passing summary for a broken "
            "run. Run the sidecar as its own user, with --trainer-uid for the trainers' uid and "
            "--socket-group for a group both share (README: the quick start)")


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


class StartupError(RuntimeError):
    """The sidecar could not start serving; the message names what and why."""


class Sidecar:
    """A registry and everything that serves it, started and stopped together."""

    def __init__(self, registry: Registry, actions: Actions | None, config: ServerConfig,
                 enforcer: Enforcer | None = None, pager: PagerSet | None = None,
                 store: Store | None = None, history_queue: HistoryQueue | None = None,
                 state_dir: str | None = None, runbooks_follow_metrics: bool = False,
                 state_lock: StateDirLock | None = None) -> None:
        self.registry = registry
        #: Where the summary signing key is kept (None: a key for this process only).
        self.state_dir = state_dir
        self.signer: SummarySigner | None = None
        #: The state dir's lock, held until ``close`` (or the process's end).
        self.state_lock = state_lock
        #: Commits the runs' step and log history behind ingest (the registry queues it).
        self.history_queue = history_queue
        self.actions = actions
        self.config = config
        self.enforcer = enforcer
        self.pager = pager
        self.store = store
        #: The pagers' runbook links name /metrics' real address once it is bound.
        self.runbooks_follow_metrics = runbooks_follow_metrics
        self.watcher: CheckpointWatcher | None = None
        if config.watch_checkpoints:
            self.watcher = CheckpointWatcher(registry, config.checkpoint_settle_seconds,
                                             roots=config.watch_roots)
            if not config.watch_roots:
                log.info("checkpoint_paths_owned", note="no --watch-root given: a run's "
                         "checkpoints are read when their folder and files belong to the "
                         "run's attested uid")
        self.attestation: AttestationServer | None = None
        operators = operator_uids(registry.trainer_uids, config.operator_uids)
        if config.socket_path and registry.attestor is not None:
            # The operator's uids attest too (``deadweight stop``/``silence``); a RunStart
            # from one of them is still refused unless it is a trainer uid.
            allowed = (registry.trainer_uids | operators if registry.trainer_uids
                       else frozenset())
            self.attestation = AttestationServer(attest_path(config.socket_path),
                                                 registry.attestor, group=config.socket_group,
                                                 allowed_uids=allowed)
        #: Stop and silence by hand (needs the actions, which journal them).
        self.oncall = (Oncall(registry, actions, registry.attestor, operators)
                       if actions is not None else None)
        self.server = SidecarServer(registry, config, oncall=self.oncall)
        self.collector = DeadweightCollector(registry, actions, registry.detectors,
                                             attestation=self.attestation,
                                             pagers=pager.health() if pager else (),
                                             auth_failures=self.server.auth_failures)
        self._http: MetricsServer | None = None
        #: How to stop each part that started, in start order.
        self._running: list[Callable[[], None]] = []
        self.metrics_port: int | None = None

    @property
    def grpc_port(self) -> int | None:
        return self.server.grpc_port

    def start(self) -> None:
        """Resume what a previous sidecar left, then serve; raise StartupError naming what
        could not be served (a socket in use, a port taken, a folder that cannot be made).

        After a StartupError, ``stop`` and ``close`` undo what had started.
        """
        check_transport(self.config)
        if self.config.socket_path:
            for path in (Path(self.config.socket_path), attest_path(self.config.socket_path)):
                try:
                    refuse_if_listening(path)
                except OSError as err:
                    raise StartupError(str(err)) from err
        if self.oncall is not None and self.store is not None:
            self.oncall.silences.load(self.store)  # before resume re-asserts pages
        if self.pager is not None and self.actions is not None:
            # What a previous sidecar journaled and no receiver acknowledged goes first.
            self.pager.restore(self.actions.settle_restored_page)
        self.registry.resume()
        if self.oncall is not None:
            clock = SilenceClock(self.oncall)
            clock.start()
            self._running.append(clock.stop)
        if self.history_queue is not None:  # stopped after the server: the last rows land
            self.history_queue.start()
            self._running.append(self.history_queue.stop)
        if self.enforcer is not None:
            self.enforcer.resume()
            self.enforcer.start()
        if self.config.metrics_address:
            host, port = _host_port(self.config.metrics_address)
            try:
                self._http = MetricsServer(host, port, self.collector.exposition)
            except OSError as err:
                raise StartupError(f"cannot serve /metrics on {host}:{port}: "
                                   f"{err.strerror or err}") from err
            self._running.append(self._http.stop)
            self.metrics_port = self._http.port
            log.info("metrics_listening", address=f"{host}:{self.metrics_port}")
            if self.runbooks_follow_metrics:
                pattern = runbook_pattern_for(self.config.metrics_address, self.metrics_port)
                for target in self.pager.targets if self.pager is not None else ():
                    target.runbook_url_pattern = pattern
                self.registry.notices.follow(pattern)  # the trainers' console lines
                log.info("runbook_links", pattern=pattern)
        if self.config.socket_path:
            folder = Path(self.config.socket_path).parent
            try:
                folder.mkdir(parents=True, exist_ok=True, mode=0o750)
                if self.config.socket_group is not None and folder.stat().st_uid == os.geteuid():
                    os.chown(folder, -1, self.config.socket_group)  # the group may enter it
            except OSError as err:
                raise StartupError(f"cannot create the socket folder {folder}: "
                                   f"{err.strerror or err}") from err
        self._start_signer()
        if self.attestation is not None:
            try:
                self.attestation.start()
            except OSError as err:
                raise StartupError(f"cannot serve attestation on {self.attestation.path}: "
                                   f"{err}") from err
            self._running.append(self.attestation.stop)
        if self.watcher is not None:
            self.watcher.start()
            self._running.append(self.watcher.stop)
            self.registry.attach_watcher(self.watcher)
        try:
            self.server.start()
        except (OSError, RuntimeError) as err:
            where = self.config.listen or self.config.socket_path
            raise StartupError(f"cannot serve gRPC on {where}: {err}") from err
        self._running.append(self.server.stop)

    def _start_signer(self) -> None:
        """The key that signs run summaries: the state dir's, else one for this process with
        its public half beside the socket (no unix socket, no attestation: nothing to sign)."""
        if self.state_dir:
            folder, persistent = Path(self.state_dir), True
        elif self.config.socket_path:
            folder, persistent = Path(self.config.socket_path).parent, False
        else:
            return
        try:
            from .store.signing_key import BadKey, KeyUnsafe, SummarySigner
        except ImportError as err:  # a broken install: watch runs, sign nothing, say so
            log.error("summary_signing_off", error=str(err), note="the cryptography package "
                      "is missing: run summaries are written unsigned")
            return
        try:
            self.signer = SummarySigner.in_folder(folder, persistent)
        except (KeyUnsafe, BadKey, OSError) as err:
            raise StartupError(f"cannot load the summary signing key in {folder}: {err}"
                               ) from err
        self.server.signer = self.signer
        if self.config.socket_path and key_within_trainers_reach(self.registry.trainer_uids):
            warning = signing_key_warning(self.signer, self.registry.trainer_uids)
            log.warning("signing_key_readable_by_trainers", uid=os.geteuid(),
                        trainer_uids=sorted(self.registry.trainer_uids) or "any",
                        key=str(folder / "summary-signing.key") if persistent
                        else "this process's memory", note=warning)
            self.server.warnings.append(warning)

    def stop(self) -> None:
        """Stop serving, newest part first (the process state is closed by ``close``)."""
        while self._running:
            self._running.pop()()

    def wait(self) -> None:
        """Block until the gRPC server ends (``stop`` from a signal handler ends it)."""
        self.server.wait()

    def close(self) -> None:
        """After stop: end enforcement, close the pager and the store."""
        if self.enforcer is not None:
            self.enforcer.stop()
        if self.pager is not None:
            self.pager.close()
        if self.store is not None:
            self.store.close()
        if self.state_lock is not None:
            self.state_lock.release()


def build(config: SidecarConfig) -> Sidecar:
    """Every part of a sidecar, in dependency order, from its configuration.

    Raises StateDirLocked when another sidecar holds the state dir (before its database is
    touched)."""
    state_lock = StateDirLock(config.state_dir) if config.state_dir else None
    try:
        store = Store(config.state_dir)
    except BaseException:
        if state_lock is not None:
            state_lock.release()
        raise
    history_queue = HistoryQueue(store)
    follow = config.runbook_url_pattern is None and bool(config.server.metrics_address)
    runbooks = config.runbook_url_pattern or DEFAULT_RUNBOOK_URL_PATTERN
    targets: list[PagerTarget] = []
    if config.alertmanager_url:
        targets.append(AlertmanagerPusher(
            config.alertmanager_url, runbooks, config.dashboard_url_pattern, journal=store,
            resend_interval=config.pager_resend_interval, deadline=config.pager_deadline,
            backoff_initial=config.pager_backoff, backoff_max=config.pager_backoff_max))
    targets += [WebhookNotifier(
        url, index, runbooks, config.dashboard_url_pattern, journal=store,
        deadline=config.pager_deadline, backoff_initial=config.pager_backoff,
        backoff_max=config.pager_backoff_max) for index, url in enumerate(config.webhook_urls)]
    pager = PagerSet(targets) if targets else None

    def escalate(run: RunSnapshot, finding: Finding, stop_at: float, stop_step: int) -> None:
        # Called only from ingest, so once the sidecar is built: the enforcer exists by then.
        enforcer.begin(run, finding, stop_at, stop_step)

    def supersede(run_id: str, incarnation: int) -> None:
        enforcer.supersede(run_id, incarnation)

    actions = Actions(pager=pager, dry_run=config.dry_run, store=store, escalate=escalate,
                      supersede=supersede)
    registry = Registry(actions, settings=config.settings, policies=config.policies,
                        max_runs=config.max_runs, ended_ttl_seconds=config.run_ttl_seconds,
                        max_runs_per_process=config.max_runs_per_process,
                        max_runs_per_uid=config.max_runs_per_uid,
                        reclaim_unstepped_seconds=config.reclaim_unstepped_seconds,
                        store=store, attestor=Attestor(),
                        allow_unattested=config.allow_unattested,
                        silent_run_seconds=config.silent_run_seconds,
                        trainer_uids=config.trainer_uids, max_ranks=config.max_ranks,
                        history_queue=history_queue,
                        runbook_url_pattern=runbooks)
    enforcer = Enforcer(registry, store, actions, stop_grace_seconds=config.stop_grace_seconds,
                        kill_grace_seconds=config.kill_grace_seconds)
    return Sidecar(registry, actions, config.server, enforcer=enforcer, pager=pager,
                   store=store, history_queue=history_queue, state_dir=config.state_dir,
                   runbooks_follow_metrics=follow, state_lock=state_lock)
