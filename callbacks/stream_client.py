"""The training side of the gRPC stream: a bounded queue and one background sender thread.

The training thread only appends a record to a deque (drop-oldest, counted) and returns; the
sender thread turns records into ``deadweight.v1`` events, batches them, keeps unacknowledged
events for a resend after a reconnect, sends heartbeats, and collects the sidecar's directives.
A sidecar that is absent, slow or restarting costs the job one warning, never an exception.

The hand-off reads no clock: each record carries its ordinal, and the sender stamps it with the
first of its own clock marks taken after that ordinal was submitted (it takes one at every
wake-up, every ``flush_seconds`` at most, also while the sidecar is away). A record's time is
thus never before its hand-off and at most about one flush interval after it. Drops are counted
by the sender from gaps in the ordinals, so ``submit`` touches no counter of its own but one.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from ..proto import monitor_stub, pb
from ..proto.transport import (
    attest_path,
    bearer_metadata,
    grpc_target,
    open_channel,
    unix_socket_path,
)
from .where import where

log = logging.getLogger("deadweight")


@dataclass(frozen=True)
class ClientSettings:
    """Tunables of the stream; the defaults suit a run that steps every 10 ms to 10 min."""

    max_queue: int = 10_000
    max_inflight: int = 10_000
    batch_size: int = 256
    heartbeat_seconds: float = 5.0
    #: The sender drains the queue at least this often (and stamps records with this
    #: precision); submit() never wakes it (submit_now() does, for a record that should not
    #: wait), so a hand-off costs no thread switch.
    flush_seconds: float = 0.05
    connect_timeout_seconds: float = 2.0
    backoff_initial_seconds: float = 0.2
    backoff_max_seconds: float = 10.0


#: Clock marks kept for records not yet taken: at one a flush interval, minutes of an outage;
#: past that, records are stamped later than their hand-off (never earlier).
_MAX_MARKS = 4096

def fetch_attestation(socket_path: str, timeout: float = 1.0, attempts: int = 5,
                      backoff_seconds: float = 0.1) -> str | None:
    """A one-time nonce from the sidecar's attestation socket, None when it has none.

    The sidecar learns this process's pid from the kernel when it connects there; the nonce,
    sent in RunStart, lets the sidecar bind the run to this process (and only this one). A
    busy listener (a flood of connections, a full backlog) is tried again with a growing
    pause; no listener at all (an older sidecar) is not. This runs on the sender thread,
    never on the training thread.
    """
    for attempt in range(attempts):
        try:
            return _fetch_attestation_once(socket_path, timeout)
        except FileNotFoundError:
            return None
        except OSError:
            if attempt + 1 < attempts:
                time.sleep(backoff_seconds * 2**attempt)
    return None


def _fetch_attestation_once(socket_path: str, timeout: float) -> str | None:
    """One exchange; raises OSError when the listener was busy or the answer incomplete."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            # Blocking mode with kernel timeouts, not settimeout(): a non-blocking connect to
            # a unix socket with a full backlog fails at once (EAGAIN), while a blocking one
            # queues in the kernel until the listener drains its backlog (or the timeout).
            limit = struct.pack("ll", int(timeout), int((timeout % 1) * 1_000_000))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            sock.connect(str(attest_path(socket_path)))
            data = b""
            while not data.endswith(b"\n") and len(data) < 256:
                chunk = sock.recv(256)
                if not chunk:
                    break
                data += chunk
    except FileNotFoundError:
        raise
    except OSError as err:
        raise OSError(f"attestation socket busy: {err}") from err
    status, _, nonce = data.decode(errors="replace").strip().partition(" ")
    if not data.endswith(b"\n"):
        raise OSError("attestation answer cut short")
    return nonce if status == "OK" and nonce else None


#: Longest wait at close for a fully acknowledged stream to end by itself.
_STREAM_END_GRACE_SECONDS = 1.0

#: Longest wait for grpc's connectivity poller to notice nobody watches the channel any more
#: (it checks every 0.2 s).
_POLLER_GRACE_SECONDS = 0.5


def _close_quietly(channel: grpc.Channel) -> None:
    """Close channel once grpc's connectivity poller has stopped.

    The poller runs in its own thread while a ready-future watches the channel and for up to
    0.2 s after; a channel closed under it makes that thread die with "Cannot monitor channel
    state: Channel closed!". The poller's flag is private to grpc: absent, this just closes.
    """
    state = getattr(channel, "_connectivity_state", None)
    deadline = time.monotonic() + _POLLER_GRACE_SECONDS
    while getattr(state, "polling", False) and time.monotonic() < deadline:
        time.sleep(0.01)
    channel.close()


class StreamClient:
    """One (run_id, rank) stream to the sidecar, fed without blocking the training thread."""

    # Slots: ``submit`` reads its two fields from the object itself, not from a values array
    # of forty entries that the sender thread writes to (``__dict__`` stays for subclasses).
    __slots__ = (
        "__dict__", "_attest_warned", "_attestation", "_channel", "_closing", "_connected",
        "_directives", "_evicted", "_inflight", "_inflight_dropped", "_last_taken", "_lock",
        "_marks", "_metadata", "_notices", "_pending_resend", "_queue", "_ready", "_rejections",
        "_reported_dropped", "_run_start", "_seq", "_start_acked", "_stop", "_thread",
        "_tls_root", "_to_event", "_trainer_thread", "_wake", "_warned", "address",
        "began_step", "connects", "evaluated_batches", "firing", "last_step", "phase",
        "phase_at", "phase_pass",
        "phase_step", "rank", "report_command", "run_id", "sent", "settings", "submitted",
        "unreachable_told",
    )

    def __init__(
        self,
        address: str,
        run_id: str,
        rank: int,
        to_event: Callable[[str, Any], pb.Event],
        token: str | None = None,
        settings: ClientSettings | None = None,
        tls_ca: str | None = None,
    ) -> None:
        self.address = address
        self.run_id = run_id
        self.rank = rank
        self.settings = settings or ClientSettings()
        self._to_event = to_event
        self._metadata = bearer_metadata(token)
        self._tls_root = self._read_ca(tls_ca)
        self._attestation = ""
        self._attest_warned = False
        #: (kind, record, ordinal); full, the append drops the oldest (see ``dropped``).
        self._queue: deque[tuple[str, Any, int]] = deque(maxlen=self.settings.max_queue)
        #: (records submitted, time.time()) taken by the sender at each wake-up: the stamps.
        self._marks: deque[tuple[int, float]] = deque(maxlen=_MAX_MARKS)
        #: Ordinal of the last record the sender took, and the records evicted before it.
        self._last_taken = 0
        self._evicted = 0
        self._inflight_dropped = 0
        self._inflight: deque[pb.Event] = deque()
        self._directives: deque[pb.Directive] = deque()
        #: The words of verdicts the sidecar told this stream, for the trainer's console.
        self._notices: deque[pb.VerdictNotice] = deque(maxlen=1024)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._start_acked = threading.Event()
        self._lock = threading.Lock()
        self._run_start: pb.Event | None = None
        self._pending_resend: list[pb.Event] = []
        self.last_step = 0
        #: The newest step the loop has begun (written by the training thread, one int; the
        #: heartbeats carry it, so a rank stuck before its next step can be named).
        self.began_step = 0
        #: Evaluation batches the loop has finished (written by the training thread, one int;
        #: the heartbeats carry it, so a long evaluation is progress, not a stall).
        self.evaluated_batches = 0
        #: The phase of a step the training thread last entered (``progress``: 0 unmeasured),
        #: the step and micro-batch it belongs to, and when (time.monotonic()); written by
        #: the training thread's hooks, read by the heartbeats.
        self.phase = 0
        self.phase_step = 0
        self.phase_pass = 0
        self.phase_at = 0.0
        #: The training thread, whose stack heartbeats describe once ``began_step`` is set.
        self._trainer_thread = threading.get_ident()
        self._seq = 0
        self._warned = False
        #: Set when the trainer's console already said that no sidecar answers: the sender
        #: then adds no warning of its own (it still says when the sidecar comes back).
        self.unreachable_told = False
        self._closing = False
        #: Asked on the sender thread at each heartbeat, when set: True once the run's loop
        #: has ended without ending the run (it queued the run's end itself); the stream then
        #: ends once that is delivered.
        self.loop_left: Callable[[], bool] | None = None
        self._channel: grpc.Channel | None = None
        #: Detectors firing on this run, as of the sidecar's latest answer.
        self.firing: tuple[str, ...] = ()
        #: The command that opens the run's report, as the sidecar said in its answer to the
        #: RunStart ("" when it keeps no state dir); None until it said.
        self.report_command: str | None = None
        #: The pending wait for a connection, while there is one (close() cancels it).
        self._ready: grpc.Future | None = None
        self._reported_dropped = -1
        self._rejections: set[str] = set()
        self.submitted = 0
        self.sent = 0
        self.connects = 0
        self._thread = threading.Thread(target=self._run, name="deadweight-sender", daemon=True)

    # -- training thread -------------------------------------------------------------------

    def start(self, run_start: Any) -> None:
        """Register the run (record kind ``run_start``) and start the sender thread."""
        self._run_start = self._to_event("run_start", run_start)
        self._run_start.seq = 0  # seq 0: never deduplicated, re-sent after every reconnect
        self._run_start.time_seconds = time.time()
        self._thread.start()

    def submit(self, kind: str, record: Any) -> None:
        """Queue a record for the sender's next drain (within ``flush_seconds``); O(1), never
        blocks; a full queue drops its oldest record.

        The training thread comes here once a step with cold caches, so this reads no clock
        (the sender stamps the record, see the module docstring), takes no lock, wakes nobody
        and looks up no kind: one append and one counter, on the fields that share the cache
        line of the object's header. The counter is written after the append, so whoever
        reads it finds every record up to it already queued.
        """
        ordinal = self.submitted + 1
        self._queue.append((kind, record, ordinal))
        self.submitted = ordinal

    def submit_now(self, kind: str, record: Any) -> None:
        """Queue a record and wake the sender: for records that should not wait for the next
        drain (a checkpoint, the run end)."""
        self.submit(kind, record)
        self._wake.set()

    def take_directives(self) -> list[pb.Directive]:
        """Directives received since the last call."""
        if not self._directives:  # nearly always: twice a step, nothing to take
            return []
        taken: list[pb.Directive] = []
        while self._directives:
            taken.append(self._directives.popleft())
        return taken

    def take_notices(self) -> list[pb.VerdictNotice]:
        """Verdict notices received since the last call."""
        if not self._notices:
            return []
        taken: list[pb.VerdictNotice] = []
        while self._notices:
            taken.append(self._notices.popleft())
        return taken

    @property
    def running(self) -> bool:
        """Whether the sender still runs (the client was not closed, nor ended itself)."""
        return self._thread.is_alive()

    @property
    def connected(self) -> bool:
        """Whether a stream to the sidecar is open now."""
        return self._connected.is_set()

    def wait_registered(self, timeout: float) -> bool:
        """Wait until the sidecar acknowledged the run start (for directives at train begin)."""
        return self._start_acked.wait(timeout)

    def wait_connected(self, timeout: float) -> bool:
        """Wait until a stream to the sidecar is open."""
        return self._connected.wait(timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Flush what is queued within timeout, then stop the sender.

        A sidecar that answered once gets the whole timeout to come back (a restart); one
        that never answered costs nothing. Events left undelivered are logged, not hidden.
        """
        if not self._thread.is_alive():
            return
        self._closing = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self._connected.is_set() or self.connects) and (
            self._queue or self._inflight or self._pending_resend
        ):
            time.sleep(0.005)
        left = len(self._queue) + len(self._inflight) + len(self._pending_resend)
        if left and self.connects:
            log.warning("deadweight: %d events not delivered to the sidecar at %s at close",
                        left, self.address)
        elif self._connected.is_set():
            # Everything is acknowledged: the request stream ends by itself (nothing left,
            # closing) and the sidecar then ends its answers. Closing the channel before that
            # cancels a stream that delivered everything (a false CANCELLED warning).
            self._thread.join(min(_STREAM_END_GRACE_SECONDS,
                                  max(0.0, deadline - time.monotonic())))
        self._stop.set()
        self._wake.set()
        ready = self._ready
        if ready is not None:
            # Still connecting: cancel the wait and let the sender close its own channel.
            # Closing it here races grpc's connectivity poller ("Channel closed!").
            ready.cancel()
        else:
            channel = self._channel
            if channel is not None:
                # Ends a blocked stream read at once. The sender may have just given up a
                # connect (its ready-future cleared, the poller still running for up to
                # 0.2 s): closing under the poller leaks 'Channel closed!' from its thread.
                _close_quietly(channel)
        self._thread.join(max(0.0, deadline - time.monotonic()) + 0.5)

    @property
    def tls_root(self) -> bytes | None:
        return self._tls_root

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def dropped(self) -> int:
        """Records the full queue evicted, plus sent events the full resend buffer evicted.

        Exact on the sender thread and once the client is closed; read from another thread
        while records flow, it may lag by the records in flight.
        """
        evicted = self._evicted
        submitted = self.submitted  # first: every record up to it is queued, taken or gone
        try:
            oldest = self._queue[0][2]
        except IndexError:
            oldest = submitted + 1
        return evicted + max(0, oldest - self._last_taken - 1) + self._inflight_dropped

    # -- sender thread ---------------------------------------------------------------------

    @staticmethod
    def _read_ca(path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except OSError as err:
            log.warning("deadweight: cannot read the TLS CA file %s (%s); TCP streams will "
                        "fail the TLS handshake", path, err)
            return None

    def _attest(self, target: str) -> str:
        """A fresh nonce for this connection (unix sockets only); one warning when absent."""
        path = unix_socket_path(target)
        if path is None:
            return ""
        nonce = fetch_attestation(path, timeout=self.settings.connect_timeout_seconds)
        if nonce is None and not self._attest_warned:
            self._attest_warned = True
            log.warning("deadweight: no attestation from the sidecar at %s; it can page and "
                        "stop this run but never signal this process", self.address)
        return nonce or ""

    def _start_event(self) -> pb.Event:
        """The RunStart event carrying this connection's attestation nonce."""
        assert self._run_start is not None
        event = pb.Event()
        event.CopyFrom(self._run_start)
        event.run_start.attestation = self._attestation
        return event

    def _run(self) -> None:
        backoff = self.settings.backoff_initial_seconds
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._stream_once()
            except grpc.FutureTimeoutError:
                self._warn_unreachable("no answer")
            except grpc.FutureCancelledError:  # close() gave up waiting for a connection
                if not self.connects:
                    self._warn_unreachable("no answer before the run ended")
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                if not (self._stop.is_set() and code == grpc.StatusCode.CANCELLED):
                    self._warn_unreachable(str(code))  # not close() ending the stream
            except Exception:  # a bug here must never reach the training job
                log.exception("deadweight: sender failed; retrying")
            finally:
                self._connected.clear()
                self._requeue_inflight()
            if self._stop.is_set() or (self._closing and not self._queue):
                break
            if time.monotonic() - started > 5 * backoff:
                backoff = self.settings.backoff_initial_seconds  # the stream had been healthy
            self._wait(backoff, self._stop)
            backoff = min(backoff * 2, self.settings.backoff_max_seconds)

    def _warn_unreachable(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            if self.unreachable_told:
                return
            log.warning(
                "deadweight: sidecar at %s unreachable (%s); training continues unmonitored, "
                "reports are queued (%d max) and sent when it answers",
                self.address, why, self.settings.max_queue,
            )

    def _stream_once(self) -> None:
        target = grpc_target(self.address)
        channel = open_channel(target, self._tls_root)
        try:
            # The wait is published before the channel: close() on another thread that sees
            # the channel but no wait would close it just as grpc's poller starts on it.
            ready = grpc.channel_ready_future(channel)
            self._ready = ready
            self._channel = channel
            if self._stop.is_set():  # close() ran before it could see this wait
                ready.cancel()
            try:
                self._await_ready(ready)
            finally:
                self._ready = None
                if not ready.done():
                    ready.cancel()  # stop watching the channel's connectivity
            self._attestation = self._attest(target)  # one nonce per connection
            stub = monitor_stub(channel)
            responses = stub.Stream(self._requests(), metadata=self._metadata)
            self._connected.set()
            self.connects += 1
            if self._warned or self.unreachable_told:
                log.warning("deadweight: sidecar at %s reachable again; run %s is monitored "
                            "from here on", self.address, self.run_id)
                self._warned = False
                self.unreachable_told = False  # a later outage is warned again
            for response in responses:
                self._on_response(response)
        finally:
            _close_quietly(channel)
            self._channel = None

    def _await_ready(self, ready: grpc.Future) -> None:
        """Wait for the connection up to the connect timeout, taking clock marks meanwhile."""
        deadline = time.monotonic() + self.settings.connect_timeout_seconds
        while True:
            self._mark()
            left = deadline - time.monotonic()
            try:
                ready.result(timeout=max(0.0, min(left, self.settings.flush_seconds)))
                return
            except grpc.FutureTimeoutError:
                if left <= self.settings.flush_seconds:
                    raise

    def _on_response(self, response: pb.StreamResponse) -> None:
        rejected = response.error
        if rejected and rejected not in self._rejections and len(self._rejections) < 32:
            self._rejections.add(rejected)  # each reason once: a rejected run must not flood
            log.warning("deadweight: sidecar rejected a batch: %s", rejected)
        # The answer's words first: whoever sees the ack (``close`` waiting for the queue to
        # drain, ``wait_registered``) then finds its verdicts and directives already here.
        self._directives.extend(response.directives)
        self._notices.extend(response.verdicts)
        if response.HasField("report_command"):
            self.report_command = response.report_command
        if not rejected:
            self.firing = tuple(response.firing)
        with self._lock:
            while self._inflight and self._inflight[0].seq <= response.ack_seq:
                self._inflight.popleft()
        self._start_acked.set()

    def _requeue_inflight(self) -> None:
        """Events sent but never acknowledged go out again first after a reconnect."""
        with self._lock:
            self._pending_resend = list(self._inflight)
            self._inflight.clear()

    def _mark(self) -> None:
        """Note the time against the records submitted so far (once per wake-up)."""
        submitted = self.submitted
        marks = self._marks
        if submitted > self._last_taken and (not marks or marks[-1][0] != submitted):
            marks.append((submitted, time.time()))

    def _stamp(self, ordinal: int) -> float:
        """The time of the first mark taken once record ``ordinal`` was queued."""
        marks = self._marks
        while marks and marks[0][0] < ordinal:
            marks.popleft()
        if not marks:
            self._mark()
        return marks[0][1] if marks else time.time()

    def _wait(self, seconds: float, event: threading.Event) -> None:
        """Wait on event for up to seconds, taking a clock mark every flush interval."""
        deadline = time.monotonic() + seconds
        while not event.is_set():
            self._mark()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            event.wait(min(left, self.settings.flush_seconds))

    def _next_batch(self) -> list[pb.Event]:
        events: list[pb.Event] = []
        while self._pending_resend and len(events) < self.settings.batch_size:
            events.append(self._pending_resend.pop(0))
        self._mark()
        while self._queue and len(events) < self.settings.batch_size:
            try:
                kind, record, ordinal = self._queue.popleft()
            except IndexError:
                break
            self._evicted += ordinal - self._last_taken - 1  # the queue dropped those
            self._last_taken = ordinal
            self._seq += 1
            event = self._to_event(kind, record)
            event.seq = self._seq
            event.time_seconds = self._stamp(ordinal)
            events.append(event)
        return events

    def _requests(self) -> Iterator[pb.StreamRequest]:
        assert self._run_start is not None
        # The heartbeat right after RunStart tells a (restarted) sidecar the drop count at once.
        yield pb.StreamRequest(
            run_id=self.run_id, rank=self.rank, events=[self._start_event(), self._heartbeat()]
        )
        last_sent = time.monotonic()
        while not self._stop.is_set():
            events = self._next_batch()
            if not events:
                if self._closing:
                    return
                idle = time.monotonic() - last_sent
                if idle < self.settings.heartbeat_seconds:
                    wait = min(self.settings.flush_seconds, self.settings.heartbeat_seconds - idle)
                    self._wake.wait(wait)
                    self._wake.clear()
                    continue
                events = [self._heartbeat()]
                left = self.loop_left
                if left is not None and left():
                    self.loop_left = None
                    self._closing = True  # the run's end, queued, goes out next; then done
            elif self.dropped != self._reported_dropped:
                events.append(self._heartbeat())  # new drops are reported with the next batch
            with self._lock:
                for event in events:
                    if event.seq:
                        self._inflight.append(event)
                while len(self._inflight) > self.settings.max_inflight:
                    self._inflight.popleft()
                    self._inflight_dropped += 1
            self.sent += len(events)
            last_sent = time.monotonic()
            yield pb.StreamRequest(run_id=self.run_id, rank=self.rank, events=events)

    def _heartbeat(self) -> pb.Event:
        """Heartbeats carry no seq: they are never resent or deduplicated."""
        self._reported_dropped = self.dropped
        place = where(self._trainer_thread) if self.began_step else ""
        phase, phase_at = self.phase, self.phase_at
        return pb.Event(
            seq=0,
            time_seconds=time.time(),
            heartbeat=pb.Heartbeat(
                step=self.last_step, dropped_events=self.dropped, queued_events=len(self._queue),
                began_step=self.began_step, where=place,
                phase=phase,  # type: ignore[arg-type]
                phase_step=self.phase_step if phase else 0,
                phase_pass=self.phase_pass if phase else 0,
                phase_seconds_ago=max(0.0, time.monotonic() - phase_at) if phase else 0.0,
                evaluated_batches=self.evaluated_batches,
            ),
        )
