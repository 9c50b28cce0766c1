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

import structlog

from ..proto.transport import attest_path
from .actions.alertmanager import AlertmanagerPusher
from .actions.enforcer import Enforcer
from .actions.links import (
    DEFAULT_DASHBOARD_URL_PATTERN,
    DEFAULT_RUNBOOK_URL_PATTERN,
)
from .actions.policy import Actions
from .checkpoints.watcher import CheckpointWatcher
from .detectors.base import Policy
from .exposition.collector import DeadweightCollector
from .exposition.http import MetricsServer
from .ingest.attestation import AttestationServer
from .ingest.server import (
    ServerConfig,
    SidecarServer,
    check_transport,
    refuse_if_listening,
)
from .model.finding import Finding, RunFacts
from .model.nonces import Attestor
from .model.settings import DetectorSettings
from .registry import Registry
from .store.history_queue import HistoryQueue
from .store.journal import Store

log = structlog.get_logger("deadweight.app")


@dataclass
class SidecarConfig:
    """Everything ``deadweight serve`` is told (files already read)."""

    server: ServerConfig = field(default_factory=ServerConfig)
    state_dir: str | None = None
    alertmanager_url: str | None = None
    runbook_url_pattern: str = DEFAULT_RUNBOOK_URL_PATTERN
    dashboard_url_pattern: str = DEFAULT_DASHBOARD_URL_PATTERN
    dry_run: bool = False
    policies: dict[str, Policy] = field(default_factory=dict)
    settings: DetectorSettings = field(default_factory=DetectorSettings)
    max_runs: int = 1000
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


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


class StartupError(RuntimeError):
    """The sidecar could not start serving; the message names what and why."""


class Sidecar:
    """A registry and everything that serves it, started and stopped together."""

    def __init__(self, registry: Registry, actions: Actions | None, config: ServerConfig,
                 enforcer: Enforcer | None = None, pager: AlertmanagerPusher | None = None,
                 store: Store | None = None, history_queue: HistoryQueue | None = None
                 ) -> None:
        self.registry = registry
        #: Commits the runs' step and log history behind ingest (the registry queues it).
        self.history_queue = history_queue
        self.actions = actions
        self.config = config
        self.enforcer = enforcer
        self.pager = pager
        self.store = store
        self.watcher: CheckpointWatcher | None = None
        if config.watch_checkpoints:
            self.watcher = CheckpointWatcher(registry, config.checkpoint_settle_seconds,
                                             roots=config.watch_roots)
            if not config.watch_roots:
                log.warning("checkpoint_paths_refused", reason="no --watch-root given: no "
                            "client-named checkpoint folder is read")
        self.attestation: AttestationServer | None = None
        if config.socket_path and registry.attestor is not None:
            self.attestation = AttestationServer(attest_path(config.socket_path),
                                                 registry.attestor, group=config.socket_group,
                                                 allowed_uids=registry.trainer_uids)
        self.collector = DeadweightCollector(registry, actions, registry.detectors,
                                             attestation=self.attestation)
        self.server = SidecarServer(registry, config)
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
        self.registry.resume()
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
        if self.config.socket_path:
            folder = Path(self.config.socket_path).parent
            try:
                folder.mkdir(parents=True, exist_ok=True, mode=0o750)
                if self.config.socket_group is not None and folder.stat().st_uid == os.geteuid():
                    os.chown(folder, -1, self.config.socket_group)  # the group may enter it
            except OSError as err:
                raise StartupError(f"cannot create the socket folder {folder}: "
                                   f"{err.strerror or err}") from err
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


def build(config: SidecarConfig) -> Sidecar:
    """Every part of a sidecar, in dependency order, from its configuration."""
    store = Store(config.state_dir)
    history_queue = HistoryQueue(store)
    pager = None
    if config.alertmanager_url:
        pager = AlertmanagerPusher(config.alertmanager_url, config.runbook_url_pattern,
                                   config.dashboard_url_pattern)

    def escalate(run: RunFacts, finding: Finding, stop_at: float, stop_step: int) -> None:
        # Called only from ingest, so once the sidecar is built: the enforcer exists by then.
        enforcer.begin(run, finding, stop_at, stop_step)

    def supersede(run_id: str) -> None:
        enforcer.supersede(run_id)

    actions = Actions(pager=pager, dry_run=config.dry_run, store=store, escalate=escalate,
                      supersede=supersede)
    registry = Registry(actions, settings=config.settings, policies=config.policies,
                        max_runs=config.max_runs, ended_ttl_seconds=config.run_ttl_seconds,
                        store=store, attestor=Attestor(),
                        allow_unattested=config.allow_unattested,
                        silent_run_seconds=config.silent_run_seconds,
                        trainer_uids=config.trainer_uids, max_ranks=config.max_ranks,
                        history_queue=history_queue)
    enforcer = Enforcer(registry, store, actions, stop_grace_seconds=config.stop_grace_seconds,
                        kill_grace_seconds=config.kill_grace_seconds)
    return Sidecar(registry, actions, config.server, enforcer=enforcer, pager=pager,
                   store=store, history_queue=history_queue)
