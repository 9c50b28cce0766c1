"""The sidecar's gRPC transport: the stream service, its listeners and the periodic tick.

The gRPC server is ``grpc.aio``: a stream is a coroutine, not a thread, so hundreds of ranks
cost no thread pool. It listens on a unix socket created with mode 0660; TCP is opt-in.
``SidecarServer`` runs it in a background thread; ``app.Sidecar`` starts it together with
the ``/metrics`` endpoint, the attestation socket and the checkpoint watcher.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from ...proto import MAX_MESSAGE_BYTES, add_monitor_servicer, pb, pb_grpc
from ...proto.transport import bearer_matches
from ..registry import CheckedBatch, Peer, Registry
from .auth_failures import DEFAULT_BURST, DEFAULT_REFILL_PER_SECOND, AuthFailures
from .socket_access import grant
from .socket_claim import prepare_socket
from .summary_service import SummaryRefused, signed_summary

if TYPE_CHECKING:
    from ..store.signing_key import SummarySigner

if TYPE_CHECKING:
    from .oncall import Oncall
from ..registry.status_report import STATUS_MAX_BYTES, bounded

log = structlog.get_logger("deadweight.server")

TICK_SECONDS = 1.0
#: How long the tick evaluates runs before it lets gRPC's threads run (``tick_in_turn``).
TICK_TURN_SECONDS = 0.002
#: How often a batch waiting on the event loop for the registry lock tries again.
LOCK_POLL_SECONDS = 0.001


@dataclass
class ServerConfig:
    """Where the sidecar listens."""

    socket_path: str | None = None
    metrics_address: str | None = "127.0.0.1:9464"
    listen: str | None = None
    token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    #: Watch registered runs' output folders and inspect their checkpoints.
    watch_checkpoints: bool = True
    #: Seconds a checkpoint folder's files must stay unchanged before it is inspected
    #: (a folder the callback reported is inspected at once).
    checkpoint_settle_seconds: float = 2.0
    #: Folders under which client-named checkpoint paths may be read (``--watch-root``);
    #: empty: none is read, every run's output folder is refused with a finding.
    watch_roots: tuple[str, ...] = ()
    #: The group the unix sockets are handed to (``--socket-group``); None: the sidecar's.
    socket_group: int | None = None
    #: Uids that may stop and silence besides root (``--operator-uid``; ``oncall``).
    operator_uids: tuple[int, ...] = ()
    #: Allow TCP without TLS and a token (a private test network only).
    insecure: bool = False
    #: Failed TCP authentications a host may make before it is throttled.
    auth_failure_burst: int = DEFAULT_BURST
    #: ... and how long until a throttled host may try once more.
    auth_failure_refill_seconds: float = 1.0 / DEFAULT_REFILL_PER_SECOND
    grpc_options: list[tuple[str, int]] = field(
        default_factory=lambda: [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", STATUS_MAX_BYTES + 1024 * 1024),
        ]
    )


class MonitorServicer(pb_grpc.MonitorServiceServicer):  # type: ignore[misc]
    """Feeds each stream's batches to the registry and answers with acks and directives."""

    def __init__(self, registry: Registry, token: str | None = None,
                 signer: SummarySigner | None = None, oncall: Oncall | None = None,
                 watch_roots: tuple[str, ...] = (),
                 auth_failures: AuthFailures | None = None,
                 warnings: list[str] | None = None) -> None:
        self.registry = registry
        self.token = token
        #: What the sidecar warns about its own set-up, repeated in every Status answer.
        self.warnings = warnings if warnings is not None else []
        #: Failed tokens per peer host: throttled, logged, counted.
        self.auth_failures = auth_failures or AuthFailures()
        self.signer = signer
        #: Where adapter files may be read for a signature (as the checkpoint watcher reads).
        self.watch_roots = watch_roots
        #: Carries out Stop and Silence (None: this sidecar has no actions to take them).
        self.oncall = oncall

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        """TCP callers present the bearer token; the unix socket is guarded by its mode. A
        host that failed too often is refused before its token is compared
        (``auth_failures``)."""
        peer = context.peer()
        if self.token is None or peer.startswith("unix:"):
            return
        wait = self.auth_failures.throttled(peer)
        if wait > 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many failed authentications from this host: retry in "
                                f"{wait:.0f} s")
        if not bearer_matches(context.invocation_metadata(), self.token):
            self.auth_failures.failed(peer)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

    async def Stream(
        self,
        request_iterator: AsyncIterator[pb.StreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.StreamResponse]:
        await self._authorize(context)
        peer = Peer(address=context.peer())
        try:
            async for request in request_iterator:
                yield await self._ingest(request, peer)
                if peer.rejected:  # a rank bound to another process: this stream ends here
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, peer.rejected)
        except DecodeError as err:  # bytes that are not a StreamRequest end this stream only
            log.warning("malformed_request", peer=context.peer(), error=str(err))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"malformed deadweight.v1.StreamRequest: {err}")

    async def _ingest(self, request: pb.StreamRequest, peer: Peer) -> pb.StreamResponse:
        """Answer a batch on the event loop when nothing in it waits: its history is queued
        (``HistoryQueue``), and a batch whose run must first write (a finding fired, an
        action to call) has that done in a worker thread, so that a slow store write for one
        run stalls no other stream. A batch with a RunStart, which may read the store, is
        applied in a worker thread.

        While another thread holds the registry lock (a scrape, a Status call, a RunStart being
        applied), the batch waits on the event loop, which goes on serving meanwhile, and
        is tried again every LOCK_POLL_SECONDS. Handing such batches to worker threads
        instead made them hold the lock in turn, so that nearly every batch of a busy
        sidecar ended in a worker. Handing a small batch to a worker thread and back cost
        more than applying it (``bench/README.md``, "Figures behind the design")."""
        checked = self.registry.check(request)
        if checked.run_start:
            return await asyncio.to_thread(self._apply_and_answer, checked, peer)
        while (applied := self.registry.apply(checked, peer, wait=False)) is None:
            await asyncio.sleep(LOCK_POLL_SECONDS)
        if applied.ready is not None:
            return applied.ready
        return await asyncio.to_thread(applied.answer)

    def _apply_and_answer(self, checked: CheckedBatch, peer: Peer) -> pb.StreamResponse:
        applied = self.registry.apply(checked, peer)
        assert applied is not None  # it waited for the lock
        return applied.answer()

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        await self._authorize(context)
        response = await asyncio.to_thread(self.registry.status, request.run_id)
        if self.oncall is not None:
            for run in response.runs:
                run.silences.extend(pb.SilenceStatus(detector=s.detector, until=s.until,
                                                     reason=s.reason)
                                    for s in self.oncall.silences.of_run(run.run_id))
        answer = bounded(response)
        answer.warnings.extend(self.warnings)
        return answer

    async def Stop(self, request: pb.StopRequest, context: grpc.aio.ServicerContext
                   ) -> pb.StopResponse:
        """STOP one run by hand, for an attested operator uid (``oncall``)."""
        from .oncall import Refused

        oncall = await self._operator(context, "stop")
        try:
            caller = oncall.caller(request.attestation, context.peer().startswith("unix:"))
            return await asyncio.to_thread(oncall.stop, request, caller)
        except Refused as err:
            await self._refuse(context, "stop", request.run_id, err)
            raise

    async def Silence(self, request: pb.SilenceRequest, context: grpc.aio.ServicerContext
                      ) -> pb.SilenceResponse:
        """Silence one detector of one run, for an attested operator uid (``oncall``)."""
        from .oncall import Refused

        oncall = await self._operator(context, "silence")
        try:
            caller = oncall.caller(request.attestation, context.peer().startswith("unix:"))
            return await asyncio.to_thread(oncall.silence, request, caller)
        except Refused as err:
            await self._refuse(context, "silence", request.run_id, err)
            raise

    async def _operator(self, context: grpc.aio.ServicerContext, command: str) -> Oncall:
        await self._authorize(context)
        if self.oncall is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"this sidecar takes no {command} commands")
        assert self.oncall is not None
        return self.oncall

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, command: str, run_id: str,
                      err: Exception) -> None:
        permission = bool(getattr(err, "permission", False))
        log.warning("oncall_refused", command=command, run_id=run_id[:256], reason=str(err),
                    peer=context.peer())
        await context.abort(grpc.StatusCode.PERMISSION_DENIED if permission
                            else grpc.StatusCode.INVALID_ARGUMENT, str(err))

    async def SignSummary(
        self, request: pb.SignSummaryRequest, context: grpc.aio.ServicerContext
    ) -> pb.SignSummaryResponse:
        await self._authorize(context)
        signer = self.signer
        if signer is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this sidecar signs no summary")
            raise AssertionError("abort raises")
        try:
            return await asyncio.to_thread(signed_summary, self.registry, signer, request,
                                           context.peer().startswith("unix:"),
                                           roots=self.watch_roots)
        except SummaryRefused as refused:
            log.warning("summary_refused", run_id=request.run_id[:256], reason=str(refused))
            await context.abort(getattr(grpc.StatusCode, refused.code), str(refused))
            raise  # abort raises; this line is for the type checker


async def tick_in_turn(registry: Registry, now: float | None = None) -> None:
    """``Registry.tick`` on the event loop, one run at a time, the streams ready meanwhile
    served between two runs; the loop never waits on the lock (it tries again, as a batch
    does), and the writes the tick decided are done in a worker thread.

    Why: the tick in one go held the lock for every run's evaluation, and every stream
    waited for all of it. Yielding to the loop alone is not enough: gRPC's threads hand each
    message to the loop and need the interpreter lock for it, which the loop's thread holds
    while it evaluates. So after TICK_TURN_SECONDS of evaluation the tick waits for real (the
    lock is released in the wait). The bench row "answer during ticks of 1,000 runs"
    measures it; ``bench/README.md`` has the figures of each variant."""
    now = time.time() if now is None else now
    while (entries := registry.tick_started(now, wait=False)) is None:
        await asyncio.sleep(LOCK_POLL_SECONDS)
    turn_ends = time.perf_counter() + TICK_TURN_SECONDS
    try:
        for entry in entries:
            while not registry.tick_run(entry, now, wait=False):
                await asyncio.sleep(LOCK_POLL_SECONDS)
            if time.perf_counter() < turn_ends:
                await asyncio.sleep(0)  # the streams ready meanwhile go first
            else:  # a real wait: it lets gRPC's threads take the interpreter lock
                await asyncio.sleep(LOCK_POLL_SECONDS)
                turn_ends = time.perf_counter() + TICK_TURN_SECONDS
    except BaseException:  # cancelled (the sidecar stopping) or failed: do what was decided
        registry.flush(entries)
        raise
    await asyncio.to_thread(registry.flush, entries)


def _listen_unix(server: grpc.aio.Server, path: Path) -> None:
    """Add the unix socket listener; the socket never exists with a mode wider than 0660."""
    prepare_socket(path)
    old_umask = os.umask(0o117)
    try:
        server.add_insecure_port(f"unix://{path}")
    finally:
        os.umask(old_umask)


class InsecureTransport(ValueError):
    """The sidecar refuses to listen on TCP without TLS and a bearer token."""


def check_transport(config: ServerConfig) -> None:
    """Refuse plain TCP unless explicitly allowed; say what TCP can never do."""
    if not config.listen:
        return
    missing = [name for name, value in (("--tls-cert", config.tls_cert),
                                        ("--tls-key", config.tls_key),
                                        ("--token-file", config.token)) if not value]
    if missing and not config.insecure:
        raise InsecureTransport(
            f"refusing to listen on TCP {config.listen} without {', '.join(missing)} "
            "(pass --insecure to allow it on a private network)"
        )
    if missing:
        log.warning("tcp_insecure", listen=config.listen, missing=missing,
                    note="anyone who reaches this port can report runs")
    log.warning("tcp_cannot_kill", listen=config.listen,
                note="runs reporting over TCP have no kernel peer credentials: they can be "
                "paged and stopped, never signalled")


class SidecarServer:
    """The gRPC server and the periodic tick, on one event loop in a background thread."""

    def __init__(self, registry: Registry, config: ServerConfig,
                 signer: SummarySigner | None = None, oncall: Oncall | None = None) -> None:
        self.registry = registry
        self.config = config
        #: Failed TCP authentications (shared by every listener; exported on /metrics).
        self.auth_failures = AuthFailures(config.auth_failure_burst,
                                          1.0 / config.auth_failure_refill_seconds)
        self.signer = signer
        self.oncall = oncall
        #: What the sidecar warns about its own set-up (``deadweight status`` shows it).
        self.warnings: list[str] = []
        self.grpc_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._relisteners: list[grpc.aio.Server] = []
        self._error: BaseException | None = None

    def start(self, timeout: float = 10.0) -> None:
        """Start serving in a background thread; return when ready, raise if it failed."""
        check_transport(self.config)
        self._thread = threading.Thread(target=self._run, name="deadweight-grpc", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("sidecar did not become ready")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as err:  # reported to start() or logged
            self._error = err
            self._ready.set()
            log.exception("server_failed")
        finally:
            loop.close()

    def _new_server(self) -> grpc.aio.Server:
        server = grpc.aio.server(options=self.config.grpc_options)
        add_monitor_servicer(MonitorServicer(self.registry, self.config.token, self.signer,
                                             self.oncall, self.config.watch_roots,
                                             self.auth_failures, self.warnings),
                             server)
        return server

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        server = self._new_server()
        if self.config.socket_path:
            _listen_unix(server, Path(self.config.socket_path))
        if self.config.listen:
            if self.config.tls_cert and self.config.tls_key:
                creds = grpc.ssl_server_credentials([(self.config.tls_key, self.config.tls_cert)])
                self.grpc_port = server.add_secure_port(self.config.listen, creds)
            else:
                self.grpc_port = server.add_insecure_port(self.config.listen)
        await server.start()
        if self.config.socket_path:
            grant(self.config.socket_path, self.config.socket_group)
            log.info("grpc_listening", socket=self.config.socket_path,
                     group=os.stat(self.config.socket_path).st_gid)
        if self.config.listen:
            log.info("grpc_listening", listen=self.config.listen, port=self.grpc_port)
        self._ready.set()
        ticker = asyncio.create_task(self._tick())
        await self._stopped.wait()
        ticker.cancel()
        for extra in self._relisteners:
            await extra.stop(grace=1.0)
        await server.stop(grace=1.0)
        if self.config.socket_path:
            Path(self.config.socket_path).unlink(missing_ok=True)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                await tick_in_turn(self.registry)
                await self._relisten_if_deleted()
            except Exception:
                log.exception("tick_failed")

    async def _relisten_if_deleted(self) -> None:
        """A deleted socket file keeps open streams alive but locks every new rank out, while
        the sidecar still looks up: listen again on the same path (open streams stay put)."""
        if not self.config.socket_path:
            return
        path = Path(self.config.socket_path)
        if path.exists() or path.is_symlink():
            return
        log.error("socket_missing", socket=str(path), action="listening again")
        server = self._new_server()
        _listen_unix(server, path)
        await server.start()
        grant(path, self.config.socket_group)
        self._relisteners.append(server)

    def stop(self) -> None:
        """Stop serving and wait for the thread."""
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stopped.set)
        if self._thread is not None:
            self._thread.join(10)

    def wait(self) -> None:
        """Block until the server thread ends."""
        if self._thread is not None:
            self._thread.join()
