"""Batches answered on the sidecar's event loop, and the event loop never waiting.

A real ``app.Sidecar`` (grpc.aio on a real unix socket) with the history queue that
``deadweight serve`` builds: a batch whose history is only queued is answered on the event
loop; when another thread holds the registry lock the batch waits in a worker thread, and the
event loop goes on serving other streams meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from deadweight.proto import pb
from deadweight.sidecar.ingest.server import ServerConfig
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.serve import Sidecar
from deadweight.sidecar.store.history_queue import HistoryQueue
from deadweight.sidecar.store.journal import Store
from tests.support.faults import Pipe
from tests.support.raw_client import frozen_events, healthy_events, run_start
from tests.support.realprocs import wait_for

STREAM = "/deadweight.v1.MonitorService/Stream"


class Served:
    """A sidecar in this process, built as ``deadweight serve`` builds its history path."""

    def __init__(self, folder: Path) -> None:
        self.store = Store(folder / "state")
        self.queue = HistoryQueue(self.store, interval=0.05)
        self.registry = Registry(store=self.store, history_queue=self.queue)
        self.address = f"unix://{folder / 'deadweight.sock'}"
        config = ServerConfig(socket_path=str(folder / "deadweight.sock"), metrics_address=None,
                              watch_checkpoints=False)
        self.sidecar = Sidecar(self.registry, None, config, store=self.store,
                               history_queue=self.queue)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    served = Served(tmp_path)
    served.sidecar.start()
    try:
        yield served
    finally:
        served.sidecar.stop()
        served.sidecar.close()


def _start(run_id: str) -> pb.StreamRequest:
    return pb.StreamRequest(run_id=run_id, rank=0,
                            events=[pb.Event(seq=0, run_start=run_start())])


def _batch(run_id: str, step: int, frozen: bool = False) -> pb.StreamRequest:
    events = (frozen_events if frozen else healthy_events)(step, 2 * step - 1)
    return pb.StreamRequest(run_id=run_id, rank=0, events=events)


def test_batches_are_answered_and_their_history_committed_behind_them(served: Served) -> None:
    pipe = Pipe(served.address, attest=False)
    assert not pipe.send(_start("frozen")).error
    firing: list[str] = []
    for step in range(1, 9):
        answer = pipe.send(_batch("frozen", step, frozen=True))
        assert not answer.error and answer.ack_seq == 2 * step
        firing = list(answer.firing)
    assert "frozen_weights" in firing  # the verdict came back in the batch's own answer
    wait_for(lambda: len(served.store.history("frozen", "step")) == 8, 20,
             what="the queued steps in the database")
    # A batch's steps and logs are queued one after the other: the queue's thread can commit
    # the last steps in one flush and their logs in the next.
    wait_for(lambda: len(served.store.history("frozen", "log")) >= 8, 20,
             what="the queued logs in the database")
    assert [s for s, _, _ in served.store.history("frozen", "log")] == list(range(1, 9))
    assert served.queue.commits < 8  # not a commit per batch


def test_a_held_registry_lock_never_stalls_the_event_loop(served: Served) -> None:
    pipe = Pipe(served.address, attest=False)
    assert not pipe.send(_start("held")).error
    assert pipe.send(_batch("held", 1)).ack_seq == 2
    with ThreadPoolExecutor(2) as pool:
        with served.registry.lock:  # another thread (the tick, /metrics) holds it
            waiting = pool.submit(pipe.send, _batch("held", 2))
            # Meanwhile the event loop serves another stream: bytes that are not a batch are
            # refused there, which needs no lock.
            refused = pool.submit(_send_raw, served.address, b"\xff\xff\xff\xff")
            code = refused.result(timeout=60)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert not waiting.done()  # still waiting for the lock, in a worker thread
        assert waiting.result(timeout=60).ack_seq == 4
    run = served.registry.run("held")
    assert run is not None and [p.step for p in run.ranks[0].steps] == [1, 2]  # applied once
    assert served.registry.duplicate_events == 0


def _send_raw(address: str, payload: bytes) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(STREAM)  # identity serializers: raw bytes on the wire
        try:
            list(call(iter([payload]), timeout=60))
        except grpc.RpcError as err:
            return err.code()  # type: ignore[attr-defined,no-any-return]
    raise AssertionError("raw bytes were answered as a batch")
