"""The transport both sides share (addresses, the token header, the attestation path), and
the client's hand-off as a sidecar sees it: record times and drop counts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from deadweight.callbacks.stream_client import ClientSettings, StreamClient
from deadweight.proto import add_monitor_servicer, pb, pb_grpc
from deadweight.proto.transport import (
    attest_path,
    bearer_matches,
    bearer_metadata,
    grpc_target,
    unix_socket_path,
)
from tests.support.realprocs import wait_for


@pytest.mark.parametrize(
    ("address", "target", "path"),
    [("/run/d.sock", "unix:///run/d.sock", "/run/d.sock"),
     ("unix:///run/d.sock", "unix:///run/d.sock", "/run/d.sock"),
     ("unix:/run/d.sock", "unix:/run/d.sock", "/run/d.sock"),
     ("127.0.0.1:5000", "127.0.0.1:5000", None),
     ("dns:///sidecar:5000", "dns:///sidecar:5000", None)],
)
def test_an_address_becomes_one_target_and_socket_path(
    address: str, target: str, path: str | None
) -> None:
    assert grpc_target(address) == target
    assert unix_socket_path(grpc_target(address)) == path


def test_the_attestation_socket_sits_next_to_the_grpc_socket() -> None:
    assert str(attest_path("/run/d.sock")) == "/run/d.sock.attest"


def test_the_token_the_client_sends_is_the_one_the_sidecar_accepts() -> None:
    assert bearer_matches(bearer_metadata("s3cret"), "s3cret")
    for offered in (bearer_metadata("s3cre"), bearer_metadata("s3cretx"), bearer_metadata(None),
                    bearer_metadata(""), (("authorization", "s3cret"),), None):
        assert not bearer_matches(offered, "s3cret"), offered


# -- the client's hand-off: stamps and drops, seen on a real gRPC stream ------------------------

class _Recorder(pb_grpc.MonitorServiceServicer):  # type: ignore[misc]
    """A MonitorService that keeps every event it receives and acknowledges each batch."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[pb.Event] = []
        self.received_at: list[float] = []

    def Stream(self, requests: Iterator[pb.StreamRequest], context: object,
               ) -> Iterator[pb.StreamResponse]:
        for request in requests:
            now = time.time()
            self.events.extend(request.events)
            self.received_at.extend(now for _ in request.events)
            yield pb.StreamResponse(ack_seq=max((e.seq for e in request.events), default=0))

    def logs(self) -> list[tuple[pb.Event, float]]:
        return [(e, at) for e, at in zip(self.events, self.received_at, strict=True)
                if e.WhichOneof("body") == "log"]

    def heartbeat_drops(self) -> list[int]:
        return [e.heartbeat.dropped_events for e in self.events
                if e.WhichOneof("body") == "heartbeat"]


def _serve(path: Path, recorder: _Recorder) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add_monitor_servicer(recorder, server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


def _event(kind: str, record: object) -> pb.Event:
    """Logs carry their step; the run start is empty (the recorder reads neither)."""
    if kind == "log":
        return pb.Event(log=pb.LogReport(step=int(str(record))))
    return pb.Event(run_start=pb.RunStart())


_QUICK = ClientSettings(flush_seconds=0.02, heartbeat_seconds=0.2, connect_timeout_seconds=0.3,
                        backoff_initial_seconds=0.05, backoff_max_seconds=0.1)


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "s.sock"


def test_a_record_is_stamped_no_earlier_than_its_hand_off(socket_path: Path) -> None:
    """submit() reads no clock; the sender's stamp still follows the hand-off, never precedes
    it (a clock kept on the side and read by submit would be up to a flush interval old)."""
    recorder = _Recorder()
    server = _serve(socket_path, recorder)
    client = StreamClient(f"unix://{socket_path}", "stamps", 0, _event, settings=_QUICK)
    try:
        client.start(object())
        assert client.wait_registered(10)
        handed: list[float] = []
        for step in range(1, 6):
            wait_for(lambda: len(recorder.logs()) == len(handed), what="the previous log")
            handed.append(time.time())
            client.submit("log", step)
        logs = wait_for(lambda: len(recorder.logs()) == 5 and recorder.logs(), what="5 logs")
        for (event, received), before in zip(logs, handed, strict=True):
            assert before <= event.time_seconds <= received
    finally:
        client.close(timeout=2)
        server.stop(None)


def test_records_queued_while_the_sidecar_is_away_keep_their_hand_off_time(
        socket_path: Path) -> None:
    """Records wait in the queue during an outage; they are stamped by the sender's clock
    marks taken meanwhile, not when the sidecar comes back."""
    client = StreamClient(f"unix://{socket_path}", "outage", 0, _event, settings=_QUICK)
    recorder = _Recorder()
    server = None
    try:
        client.start(object())
        before = time.time()
        client.submit("log", 1)
        # the sender, still failing to connect, takes a mark covering the record
        wait_for(lambda: client._marks and client._marks[-1][0] >= 1, what="a clock mark")
        back = time.time()
        server = _serve(socket_path, recorder)
        logs = wait_for(recorder.logs, what="the queued log")
        assert before <= logs[0][0].time_seconds <= back
    finally:
        client.close(timeout=2)
        if server is not None:
            server.stop(None)


def test_a_full_queue_drops_its_oldest_records_and_reports_how_many(socket_path: Path) -> None:
    """submit() keeps no drop counter: the count comes from gaps in the records' ordinals,
    and reaches the sidecar in a heartbeat."""
    recorder = _Recorder()
    server = _serve(socket_path, recorder)
    settings = ClientSettings(max_queue=4, flush_seconds=0.02, heartbeat_seconds=0.2)
    client = StreamClient(f"unix://{socket_path}", "drops", 0, _event, settings=settings)
    try:
        for step in range(1, 11):  # the sender is not running yet: the queue overflows
            client.submit("log", step)
        assert (client.submitted, client.queued, client.dropped) == (10, 4, 6)
        client.start(object())
        logs = wait_for(lambda: len(recorder.logs()) == 4 and recorder.logs(), what="4 logs")
        assert [e.log.step for e, _ in logs] == [7, 8, 9, 10]  # the newest four
        wait_for(lambda: 6 in recorder.heartbeat_drops(), what="a heartbeat with 6 drops")
        for step in range(11, 13):  # nothing more is dropped once the sender drains
            client.submit("log", step)
        wait_for(lambda: len(recorder.logs()) == 6, what="6 logs")
        assert client.dropped == 6
    finally:
        client.close(timeout=2)
        server.stop(None)


def test_submit_now_wakes_the_sender_that_otherwise_drains_on_its_timer(
        socket_path: Path) -> None:
    """submit() leaves a record for the next drain; submit_now() (checkpoints, the run end)
    sends it at once. The drain timer and the heartbeat are set far beyond the test's wait."""
    recorder = _Recorder()
    server = _serve(socket_path, recorder)
    settings = ClientSettings(flush_seconds=600, heartbeat_seconds=600)
    client = StreamClient(f"unix://{socket_path}", "now", 0, _event, settings=settings)
    try:
        client.start(object())
        assert client.wait_registered(10)
        client.submit("log", 1)
        client.submit_now("log", 2)  # wakes the sender, which drains both
        logs = wait_for(lambda: len(recorder.logs()) == 2 and recorder.logs(), what="2 logs")
        assert [e.log.step for e, _ in logs] == [1, 2]
    finally:
        client.close(timeout=2)
        server.stop(None)
