"""Hostile input at the real gRPC API of a real ``deadweight serve``, and a blind-sidecar check.

Bytes that are not a protobuf, messages past the size limit, unknown run ids, repeated and
out-of-order steps, NaN everywhere: each gets a clear error (or is absorbed), the daemon
stays up and keeps serving other streams. A run that goes silent is not shown as healthy:
it turns ``stalled``, its last step time stops moving, and Prometheus sees the sidecar's
own liveness through ``up`` and ``deadweight_sidecar_info``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from deadweight.callbacks.stream_client import grpc_target
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import MAX_MESSAGE_BYTES, pb
from tests.support.faults import Pipe, metric_value
from tests.support.realprocs import start_prometheus, wait_for

pytestmark = pytest.mark.slow

STREAM = "/deadweight.v1.MonitorService/Stream"
NO_SEND_LIMIT = [("grpc.max_send_message_length", -1)]


@pytest.fixture(scope="module")
def hardened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    """A sidecar with short clocks: silent runs stall after 2 s, ended runs expire after 2 s."""
    extra = ["--run-ttl-seconds", "2", "--setting", "stalled_seconds=2", "--max-runs", "50"]
    with SidecarProcess(tmp_path_factory.mktemp("hardened"), extra_args=extra) as process:
        yield process


def _alive(sidecar: SidecarProcess) -> None:
    assert sidecar.process is not None and sidecar.process.poll() is None
    sidecar.status()  # still answers


def _start(run_id: str, rank: int = 0) -> pb.StreamRequest:
    start = pb.RunStart(trainer="SFTTrainer", config={"learning_rate": 1e-4})
    return pb.StreamRequest(run_id=run_id, rank=rank, events=[pb.Event(run_start=start)])


def _step(run_id: str, seq: int, step: int, **fields: Any) -> pb.StreamRequest:
    report = pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=1e-6, **fields)
    return pb.StreamRequest(run_id=run_id, events=[pb.Event(seq=seq, step=report)])


def _raw(sidecar: SidecarProcess, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(grpc_target(sidecar.address), options=NO_SEND_LIMIT) as channel:
        call = channel.stream_stream(STREAM)  # identity serializers: raw bytes on the wire
        with pytest.raises(grpc.RpcError) as caught:
            list(call(iter([payload]), timeout=10))
    err = caught.value
    assert isinstance(err, grpc.RpcError)
    return err


@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\xff", b"\x12" * 64])
def test_malformed_frames_end_only_their_stream(hardened: SidecarProcess, payload: bytes) -> None:
    err = _raw(hardened, payload)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "malformed deadweight.v1.StreamRequest" in err.details()  # type: ignore[attr-defined]
    _alive(hardened)


def test_oversized_messages_are_refused_with_resource_exhausted(
    hardened: SidecarProcess,
) -> None:
    err = _raw(hardened, b"\x0a" + b"x" * MAX_MESSAGE_BYTES)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert str(MAX_MESSAGE_BYTES) in err.details()  # type: ignore[attr-defined]
    huge = pb.StreamRequest(run_id="huge", events=[
        pb.Event(run_start=pb.RunStart(trainer="t", output_dir="x" * MAX_MESSAGE_BYTES))])
    pipe = Pipe(hardened.address, NO_SEND_LIMIT)
    with pytest.raises(grpc.RpcError) as caught:
        pipe.send(huge)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    pipe.close()
    _alive(hardened)
    assert hardened.run_status("huge") is None


def test_bad_batches_get_clear_errors_and_the_stream_stays_open(hardened: SidecarProcess) -> None:
    pipe = Pipe(hardened.address)
    try:
        unknown = pipe.send(_step("never-started", 1, 1))
        assert "unknown run_id 'never-started': send run_start first" in unknown.error
        assert "longer than 128" in pipe.send(_start("r" * 129)).error
        assert "non-printable" in pipe.send(_start("bad\nid")).error
        wide = pb.StreamRequest(run_id="hostile", events=[pb.Event(
            run_start=pb.RunStart(config={f"k{i}": 1.0 for i in range(5000)}))])
        assert "run_start.config has more than 1024 entries" in pipe.send(wide).error

        assert not pipe.send(_start("hostile")).error  # same stream, still open
        assert pipe.send(_step("hostile", 1, 5)).ack_seq == 1
        assert pipe.send(_step("hostile", 2, 5)).ack_seq == 2  # repeated step: absorbed
        assert pipe.send(_step("hostile", 3, 2)).ack_seq == 3  # older step: absorbed
        assert pipe.send(_step("hostile", 2, 9)).ack_seq == 3  # repeated seq: deduplicated
        nan = float("nan")
        answer = pipe.send(_step("hostile", 4, 6, param_sq_sum=nan, grad_sq_sum=float("inf")))
        assert answer.ack_seq == 4 and not answer.error
        status = hardened.run_status("hostile")
        assert status is not None and status.step == 6
        text = hardened.metrics()
        assert metric_value(text, "deadweight_step", run_id="hostile", rank="0") == 6
    finally:
        pipe.close()
    _alive(hardened)


def test_a_silent_run_is_stalled_not_healthy(hardened: SidecarProcess) -> None:
    pipe = Pipe(hardened.address)  # a job that hangs: its stream stays open, nothing comes
    try:
        pipe.send(_start("goes-silent"))
        for step in (1, 2, 3):
            pipe.send(_step("goes-silent", step, step))
        text = hardened.metrics()
        last_step_time = metric_value(text, "deadweight_last_step_timestamp_seconds",
                                      run_id="goes-silent", rank="0")
        assert last_step_time is not None
        wait_for(lambda: metric_value(hardened.metrics(), "deadweight_detector_firing",
                                  run_id="goes-silent", detector="stalled") == 1.0, 20,
                 what="stalled to fire on the silent run")
        text = hardened.metrics()
        assert metric_value(text, "deadweight_run_active", run_id="goes-silent") == 1.0
        assert metric_value(text, "deadweight_last_step_timestamp_seconds",
                            run_id="goes-silent", rank="0") == last_step_time
        assert metric_value(text, "deadweight_step", run_id="goes-silent", rank="0") == 3
        status = hardened.run_status("goes-silent")
        assert status is not None
        finding = {f.detector: f for f in status.findings}
        assert finding["stalled"].firing and "stalled at step 3" in finding["stalled"].summary
    finally:
        pipe.close()


def test_ended_runs_expire_from_metrics_after_the_ttl(hardened: SidecarProcess) -> None:
    pipe = Pipe(hardened.address)
    try:
        pipe.send(_start("short-lived"))
        pipe.send(_step("short-lived", 1, 1))
        end = pb.StreamRequest(run_id="short-lived",
                               events=[pb.Event(seq=2, run_end=pb.RunEnd(step=1))])
        assert pipe.send(end).ack_seq == 2
    finally:
        pipe.close()
    ended_at = time.monotonic()
    assert metric_value(hardened.metrics(), "deadweight_run_active", run_id="short-lived") == 0
    wait_for(lambda: 'run_id="short-lived"' not in hardened.metrics(), 15,
             what="the ended run to leave /metrics")
    assert time.monotonic() - ended_at >= 1.0  # not before the 2 s TTL (minus scrape slack)
    assert hardened.run_status("short-lived") is None


def test_prometheus_sees_the_sidecar_itself(tmp_path: Path) -> None:
    """`up` and deadweight_sidecar_info follow the daemon: a dead sidecar is visible."""
    sidecar = SidecarProcess(tmp_path / "sidecar").start()
    config = (
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: deadweight\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{sidecar.metrics_port}']}}]\n"
    )
    try:
        with start_prometheus(tmp_path / "prom", config) as prom:
            wait_for(lambda: prom.query('up{job="deadweight"} == 1'), 30,
                     what="the sidecar scraped as up")
            info = prom.query('deadweight_sidecar_info{job="deadweight"}')
            assert info and info[0]["value"][1] == "1"
            sidecar.stop()
            wait_for(lambda: prom.query('up{job="deadweight"} == 0'), 30,
                     what="up to drop to 0 once the sidecar is gone")
            wait_for(lambda: not prom.query('deadweight_sidecar_info{job="deadweight"}'), 30,
                     what="the sidecar's own series to go stale")
    finally:
        sidecar.stop()
