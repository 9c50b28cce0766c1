"""The trainer's console tells: what a person at the terminal sees, from real training runs.

Real SFT runs in a subprocess (``console_worker``) against real sidecar processes over a real
unix socket, under the default policy: the frozen run (adapter loaded without
``is_trainable``) prints one line per verdict with its cause, fix and runbook link, and a
summary with the root cause first; its healthy twin prints no verdict line. Without a sidecar
the run says at once that it is NOT monitored and its loggers never read "0 findings". A STOP
names the root cause and leaves a mark the script reads. A raw loop's exit never warns that
a sidecar which received everything was unreachable.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deadweight.callbacks.console import Console
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import Store
from tests.support import raw_loop_worker, zygote
from tests.support.enforcement_support import enforcement_outcome, journal, kill_sidecar
from tests.support.realprocs import wait_for
from tests.unit.test_registry import _send, _start

WORKER = Path(__file__).resolve().parents[1] / "support" / "console_worker.py"


def _train(tiny: tuple[Path, Path], out: Path, mode: str, address: str, run_id: str,
           steps: int = 8) -> tuple[list[str], dict[str, Any]]:
    """(the console's lines, the worker's report) of one real SFT run in a subprocess."""
    model_dir, adapter_dir = tiny
    done = zygote.shared().run(  # a job of its own, forked with the training stack imported
        [str(WORKER), str(model_dir), str(adapter_dir), str(out), mode, address, run_id,
         str(steps)], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr.splitlines(), json.loads(done.stdout.strip().splitlines()[-1])


def _verdict_lines(lines: list[str]) -> list[str]:
    return [line for line in lines
            if any(f"deadweight {s} " in line for s in ("CRITICAL", "WARNING", "INFO"))]


def _detector(line: str) -> str:
    found = re.search(r"deadweight (?:CRITICAL|WARNING|INFO) (\w+) ", line)
    assert found is not None, line
    return found.group(1)


def _index(lines: list[str], needle: str) -> int:
    return next(i for i, line in enumerate(lines) if needle in line)


@pytest.mark.slow
def test_a_frozen_run_prints_each_verdict_once_and_its_healthy_twin_none(
    sidecar: SidecarProcess, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    lines, report = _train(tiny, tmp_path / "frozen", "frozen", sidecar.address, "console-f1")
    begin = _index(lines, "deadweight: run console-f1 reports to the sidecar at")
    assert sidecar.address in lines[begin]
    # The session's sidecar keeps its state in memory: no report outlives it, and it says so.
    assert "which keeps no state dir (--state-dir): no report of the run will outlive it" \
        in lines[begin]
    assert begin < _index(lines, "worker: step 1")

    verdicts = _verdict_lines(lines)
    detectors = [_detector(line) for line in verdicts]
    assert len(detectors) == len(set(detectors)), verdicts  # one line per incident
    assert detectors[:2] == ["empty_optimizer", "frozen_weights"], verdicts
    empty = verdicts[0]
    assert "deadweight CRITICAL empty_optimizer (step 0): The optimizer was built with zero " \
        "parameters" in empty
    assert "Fix: Load the adapter with `PeftModel.from_pretrained(base, path, " \
        "is_trainable=True)`" in empty
    link = empty.split("Runbook: ")[1].strip()
    assert link == f"http://127.0.0.1:{sidecar.metrics_port}/runbooks/empty_optimizer"
    import urllib.request
    with urllib.request.urlopen(link, timeout=5) as page:  # the link opens the runbook
        assert "is_trainable=True" in page.read().decode()
    # empty_optimizer at step 0, before the first optimizer step ends
    assert _index(lines, "deadweight CRITICAL empty_optimizer") < _index(lines, "worker: step 1")

    summary = lines[_index(lines, "deadweight: run console-f1 ended (completed) at step 8")]
    order = [summary.index(d) for d in ("empty_optimizer (critical, step 0, firing at end)",
                                        "frozen_weights (critical", "checkpoint_unchanged")]
    assert order == sorted(order), summary
    assert report["stopped_by_deadweight"] is None and report["steps"] == 8
    assert report["logged"]["deadweight/monitored"][-1] == 1.0
    assert report["logged"]["deadweight/findings"][-1] >= 2

    lines, report = _train(tiny, tmp_path / "healthy", "healthy", sidecar.address,
                           "console-ok")
    assert _verdict_lines(lines) == [], lines
    assert any("deadweight: run console-ok reports to the sidecar" in line for line in lines)
    assert any("deadweight: run console-ok ended (completed) at step 8; no verdict" in line
               for line in lines), lines
    assert set(report["logged"]["deadweight/findings"]) == {0.0}


@pytest.mark.slow
def test_a_script_that_quiets_transformers_still_sees_every_console_line(
    sidecar: SidecarProcess, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """``transformers.logging.set_verbosity_error()`` leaves transformers' own loggers at
    ERROR: deadweight's lines ride on a logger of their own, so its WARNING lines (the run's
    begin line) and every verdict of a real sidecar still reach the console."""
    lines, _ = _train(tiny, tmp_path / "quiet", "frozen-quiet", sidecar.address, "console-q")
    assert any("deadweight: run console-q reports to the sidecar at" in line for line in lines)
    verdicts = [_detector(line) for line in _verdict_lines(lines)]
    assert {"empty_optimizer", "frozen_weights"} <= set(verdicts)
    assert len(verdicts) == len(set(verdicts))  # one line each, not one per handler
    assert any(line.startswith("deadweight: run console-q ended") for line in lines)


@pytest.mark.slow
def test_without_a_sidecar_the_run_says_at_once_it_is_not_monitored(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    address = f"unix://{tmp_path}/no-sidecar.sock"
    lines, report = _train(tiny, tmp_path / "out", "frozen", address, "console-alone", steps=4)
    said = _index(lines, f"deadweight: no sidecar answers at {address}")
    assert "run console-alone is NOT monitored" in lines[said]
    assert said < _index(lines, "worker: step 1")  # at train begin, not at train end
    assert not [line for line in lines if "unreachable" in line], lines  # said once, at begin
    assert any("console-alone ended (completed) at step 4 NOT monitored" in line
               for line in lines)
    logged = report["logged"]
    assert "deadweight/findings" not in logged  # "0 findings" would read as judged healthy
    assert set(logged["deadweight/monitored"]) == {0.0}
    assert not [k for k in logged if k.startswith("deadweight/firing/")]


@pytest.mark.slow
def test_a_stop_names_the_root_cause_and_marks_the_run(
    stopping_sidecar: SidecarProcess, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    lines, report = _train(tiny, tmp_path / "out", "frozen", stopping_sidecar.address,
                           "console-stop", steps=30)
    assert report["steps"] < 30
    stop = lines[_index(lines, "deadweight STOPPED run console-stop")]
    # the trigger is frozen_weights (the stop policy), the root cause the empty optimizer
    assert "root cause empty_optimizer: The optimizer was built with zero parameters" in stop
    assert "(stop triggered by frozen_weights)" in stop
    assert "Fix: Load the adapter with `PeftModel.from_pretrained(" in stop
    mark = report["stopped_by_deadweight"]
    assert mark.startswith("empty_optimizer: ") and "frozen_weights" in mark
    assert report["history"] == [{"deadweight/stopped_by": "empty_optimizer",
                                  "deadweight/stop_reason": mark,
                                  "step": report["history"][0]["step"]}]
    assert 1 <= report["history"][0]["step"] <= report["steps"]
    summary = lines[_index(lines, "deadweight: run console-stop ended (stopped)")]
    assert "STOPPED by deadweight, root cause empty_optimizer" in summary


DEAF_LOOP = WORKER.parent / "deaf_loop_worker.py"


def _deaf_loop(mode: str, address: str, run_id: str, steps: int
               ) -> tuple[int, list[str]]:
    """(exit code, console lines) of a raw loop that never reads ``monitor.should_stop``."""
    env = {**os.environ, "PYTHONPATH": str(WORKER.parents[2])}
    done = subprocess.run([sys.executable, str(DEAF_LOOP), mode, address, run_id, str(steps)],
                          capture_output=True, text=True, timeout=300, env=env)
    return done.returncode, done.stderr.splitlines()


@pytest.mark.slow
def test_under_the_kill_policy_the_stop_names_the_root_cause_and_the_coming_termination(
    tmp_path: Path
) -> None:
    """A frozen raw loop that ignores STOP, under a sidecar whose frozen_weights policy is
    kill: before the sidecar's SIGTERM ends it, its console named the root cause (gradients
    no optimizer holds), the trigger, the fix, the report and the termination to come. Its
    healthy twin runs to the end and prints no verdict and no STOP."""
    with kill_sidecar(tmp_path / "sidecar", tmp_path / "state", stop_grace=1.0,
                      kill_grace=1.0) as sidecar:
        code, lines = _deaf_loop("frozen", sidecar.address, "console-kill", 100_000)
        healthy_code, healthy = _deaf_loop("healthy", sidecar.address, "console-kill-ok", 12)
        store = Store(tmp_path / "state")
        wait_for(lambda: enforcement_outcome(store, "console-kill") == "terminated", 30,
                 what="the escalation to close")

    assert code == -signal.SIGTERM, lines[-20:]
    stop = lines[_index(lines, "deadweight STOPPED run console-kill ")]
    assert "(monitor.should_stop is set), root cause grad_not_in_optimizer: Parameters " \
        "receive gradients" in stop, stop
    assert "(stop triggered by frozen_weights)." in stop
    assert "Fix: Load the adapter with `is_trainable=True`" in stop
    assert "Policy kill: unless training ends within the sidecar's stop grace, this process " \
        "is about to be terminated (SIGTERM, then SIGKILL)." in stop
    assert stop.endswith("Report: deadweight report console-kill --state-dir "
                         f"{shlex.quote(str(tmp_path / 'state'))}"), stop
    # said before the termination came: the loop stepped on after the line
    assert _index(lines, "deadweight STOPPED") < len(lines) - 1
    assert not any("LOOP_ENDED" in line for line in lines)
    assert journal(store, "console-kill") == [
        ("page", "no_pager"), ("stop", "sent"), ("sigterm", "sent"), ("exit", "exited")]

    assert healthy_code == 0, healthy[-20:]
    assert _verdict_lines(healthy) == [], healthy
    assert not [line for line in healthy if "STOPPED" in line or "ABORTED" in line]
    assert any("LOOP_ENDED step=12" in line for line in healthy)
    assert any("run console-kill-ok ended (completed) at step 12; no verdict" in line
               for line in healthy), healthy


@pytest.fixture
def deadweight_log() -> Iterator[io.StringIO]:
    """What the ``deadweight`` logger prints, at every level."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("deadweight")
    logger.addHandler(handler)
    try:
        yield out
    finally:
        logger.removeHandler(handler)


@pytest.mark.slow
def test_watch_exit_never_calls_a_sidecar_that_received_everything_unreachable(
    sidecar: SidecarProcess, deadweight_log: io.StringIO
) -> None:
    """The race: close() closed the channel while the fully acknowledged stream was still
    ending, cancelling it (a false "unreachable (CANCELLED)"). A busy Python thread in the
    training process (a data loader, a tokenizer) widens the window: before the fix, 3 of 20
    exits here warned."""
    import deadweight

    busy = threading.Event()

    def spin() -> None:
        while not busy.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    runs = 20
    try:
        for i in range(runs):
            model = raw_loop_worker._net()
            optimizer = torch.optim.AdamW(model.parameters(), lr=raw_loop_worker.LR)
            with deadweight.watch(model, optimizer, run_id=f"race-{i}",
                                  address=sidecar.address) as monitor:
                for step in range(1, 7):
                    loss = model(torch.randn(4, 8)).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    monitor.log(step, loss=loss)
            assert monitor.client is not None and monitor.client.connects == 1
    finally:
        busy.set()
        spinner.join()
    said = deadweight_log.getvalue()
    assert "unreachable" not in said and "not delivered" not in said, said
    for i in range(runs):  # and the sidecar did receive everything
        run = sidecar.run_status(f"race-{i}")
        assert run is not None and run.ended and run.step == 6


@pytest.mark.slow
def test_an_abort_names_the_root_cause_and_that_the_process_is_about_to_end(
    tmp_path: Path, deadweight_log: io.StringIO
) -> None:
    """An ABORT for a frozen raw loop (queued in a real sidecar the way on-call's STOP is,
    over real gRPC): the console says it in the STOP's words, root cause first, with the fix
    and the report, and that the process is about to be terminated; the loop gets a
    ``DeadweightAbort`` that names the root cause too, and the run ends as aborted."""
    import time

    import deadweight
    from deadweight.callbacks.run_probe import DeadweightAbort
    from tests.support.inprocess_sidecar import InProcessSidecar

    sidecar = InProcessSidecar(tmp_path / "abort.sock").start()
    model = raw_loop_worker._net()
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))],
                                  lr=raw_loop_worker.LR)  # holds none of the model's
    step = 0

    def one_step(monitor: Any) -> tuple[str, ...]:
        nonlocal step
        step += 1
        raw_loop_worker.plain_step(model, optimizer, monitor, step)
        return tuple(monitor.client.firing)

    try:
        with pytest.raises(DeadweightAbort) as raised, deadweight.watch(
                model, optimizer, run_id="console-abort", address=sidecar.address) as monitor:
            wait_for(lambda: "frozen_weights" in one_step(monitor), 30,
                     what="frozen_weights to fire")
            sidecar.registry.direct("console-abort", pb.Directive(
                action=pb.Directive.ACTION_ABORT, detector="frozen_weights",
                reason="weights unchanged"))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the next acknowledgement carries it
                one_step(monitor)
        wait_for(lambda: sidecar.seen("console-abort").ended, 10, what="the run end")
        assert sidecar.seen("console-abort").end_reason == "aborted"
    finally:
        sidecar.stop()
    said = deadweight_log.getvalue().splitlines()
    line = said[_index(said, "deadweight ABORTED run console-abort ")]
    assert "(DeadweightAbort is raised into the training loop: the process is about to be " \
        "terminated), root cause grad_not_in_optimizer: Parameters receive gradients" in line
    assert "(abort triggered by frozen_weights)." in line
    assert "Fix: Load the adapter with `is_trainable=True`" in line
    # The in-process sidecar keeps no state dir: no report outlives it, and the line says so.
    assert line.endswith("Report: none kept (the sidecar has no --state-dir); while it runs: "
                         "deadweight status --json"), line
    assert [s for s in said if "deadweight ABORTED" in s] == [line]  # said once
    message = str(raised.value)
    assert message.startswith("deadweight aborted training, root cause grad_not_in_optimizer: ")
    assert message.endswith("(abort triggered by frozen_weights)"), message
    assert monitor.stopped_by_deadweight is None  # aborted, not stopped
    summary = said[_index(said, "deadweight: run console-abort ended (aborted)")]
    assert "ABORTED by deadweight, root cause grad_not_in_optimizer" in summary, summary


def _one_batch_loop(address: str, run_id: str, frozen: bool, steps: int = 3) -> None:
    """A raw loop whose every step reaches the sidecar in the batch that carries its end:
    the client drains its queue only when the run end wakes it (nothing else is due in time).
    Frozen: the optimizer holds none of the model's parameters, so frozen_weights can only
    fire on that last batch (its streak is ``steps`` long)."""
    import deadweight
    from deadweight.callbacks.stream_client import ClientSettings

    model = raw_loop_worker._net()
    params = [torch.nn.Parameter(torch.zeros(1))] if frozen else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=raw_loop_worker.LR)
    settings = ClientSettings(flush_seconds=60.0, heartbeat_seconds=60.0)
    with deadweight.watch(model, optimizer, run_id=run_id, address=address,
                          settings=settings) as monitor:
        for step in range(1, steps + 1):
            raw_loop_worker.plain_step(model, optimizer, monitor, step)
        client = monitor.client
        assert client is not None and client.sent == 0  # nothing after the RunStart yet


@pytest.mark.slow
def test_a_verdict_that_fires_on_the_batch_carrying_the_run_end_gets_its_line(
    sidecar: SidecarProcess, deadweight_log: io.StringIO
) -> None:
    """The last steps and the run end arrive together: the sidecar judges those steps before
    it ends the run, and the console prints the verdict's line (severity, cause, fix,
    runbook) before the end summary. The healthy twin, batched the same way, prints none."""
    _one_batch_loop(sidecar.address, "console-last-batch", frozen=True)
    said = deadweight_log.getvalue().splitlines()
    line = said[_index(said, "deadweight CRITICAL frozen_weights (step 3): ")]
    assert "weights unchanged for 3 optimizer steps (steps 1-3)" in line, line
    assert "Fix: Stop the run and fix what froze it" in line
    assert line.endswith(f"Runbook: http://127.0.0.1:{sidecar.metrics_port}/runbooks/"
                         "frozen_weights"), line
    end = _index(said, "deadweight: run console-last-batch ended (completed) at step 3")
    assert _index(said, "deadweight CRITICAL frozen_weights") < end
    assert "frozen_weights (critical, step 3, firing at end)" in said[end], said[end]
    run = sidecar.run_status("console-last-batch")
    assert run is not None and run.ended
    assert "frozen_weights" in {f.detector for f in run.findings}

    _one_batch_loop(sidecar.address, "console-last-batch-ok", frozen=False)
    said = deadweight_log.getvalue().splitlines()
    twin = said[_index(said, "deadweight: run console-last-batch-ok reports to the sidecar"):]
    assert _verdict_lines(twin) == [], twin
    assert any("run console-last-batch-ok ended (completed) at step 3; no verdict" in s
               for s in twin), twin


def _notice(detector: str, incident: int = 1, rank: int = 0) -> pb.VerdictNotice:
    return pb.VerdictNotice(detector=detector, severity="critical", incident=incident,
                            cause="It broke", fix="mend it", cause_rank=rank)


def test_the_console_prints_each_incident_once_and_at_most_its_cap() -> None:
    out = io.StringIO()
    logger = logging.getLogger("deadweight.test-console")
    logger.addHandler(logging.StreamHandler(out))
    logger.propagate = False
    console = Console(logger, "r", "unix:///s", max_lines=2)
    console.begin(True, 1.0)
    console.notices([_notice("b", rank=5), _notice("b", rank=5)])
    console.notices([_notice("b", rank=5), _notice("a", rank=1), _notice("c", rank=9)])
    console.notices([_notice("b", incident=2, rank=5)])  # fired again: a new incident
    lines = out.getvalue().splitlines()
    assert [_detector(line) for line in lines[1:3]] == ["b", "a"]  # the cap: 2 lines
    assert console.held == 2
    console.end(3, "completed", ["b"])
    tail = out.getvalue().splitlines()[3:]
    assert "2 more verdict lines were not printed (at most 2 a run)" in tail[0]
    assert "a (critical, step 0), b (critical, step 0, firing at end), c (" in tail[1]


def test_the_sidecar_sends_each_incident_once_a_stream_and_again_after_a_reconnect() -> None:
    registry = Registry(runbook_url_pattern="https://runbooks.example/{detector}")
    first = _send(registry, _start(optimizer_tensors=0, optimizer_params=0))
    [notice] = [n for n in first.verdicts if n.detector == "empty_optimizer"]
    assert notice.severity == "critical" and notice.incident == 1 and notice.step == 0
    assert notice.cause.startswith("The optimizer was built with zero parameters")
    assert "0 parameters" in notice.evidence
    assert "is_trainable=True" in notice.fix
    assert notice.runbook_url == "https://runbooks.example/empty_optimizer"
    again = _send(registry, pb.Event(seq=0, heartbeat=pb.Heartbeat(step=0)))
    assert "empty_optimizer" in again.firing and not again.verdicts
    reconnected = _send(registry, _start(optimizer_tensors=0, optimizer_params=0))
    assert sorted(n.detector for n in reconnected.verdicts) == sorted(
        n.detector for n in first.verdicts) == ["empty_optimizer", "no_kl_anchor"]


def test_a_console_line_is_never_glued_to_a_live_progress_bar(
    capsys: pytest.CaptureFixture[str]
) -> None:
    from tqdm import tqdm

    logger = logging.getLogger("deadweight.test-bars")
    logger.addHandler(logging.StreamHandler())  # the stderr the bar draws on
    logger.propagate = False
    bar = tqdm(total=8, file=sys.stderr, mininterval=0)
    bar.update(3)
    Console(logger, "r", "unix:///s").notices([_notice("frozen_weights")])
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    before = err[:err.index("deadweight CRITICAL frozen_weights")]
    # the bar was wiped (carriage return, blanks, carriage return) before the line was written
    assert re.search(r"it/s\]\r +\r$", before), repr(before[-80:])


def test_a_sidecar_that_comes_up_later_judges_the_run_from_then_on(
    tmp_path: Path, deadweight_log: io.StringIO
) -> None:
    """Not monitored at start, said at once; the sidecar starts while the loop trains: the
    console says the run is monitored from then on, and the end summary is no longer
    "NOT monitored"."""
    import deadweight
    from deadweight.callbacks.stream_client import ClientSettings
    from tests.support.inprocess_sidecar import InProcessSidecar

    socket_path = tmp_path / "late.sock"
    model = raw_loop_worker._net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=raw_loop_worker.LR)
    settings = ClientSettings(backoff_initial_seconds=0.05, backoff_max_seconds=0.2,
                              connect_timeout_seconds=0.5)
    late = None
    try:
        with deadweight.watch(model, optimizer, run_id="late-sidecar",
                              address=f"unix://{socket_path}", settings=settings) as monitor:
            assert "run late-sidecar is NOT monitored" in deadweight_log.getvalue()
            late = InProcessSidecar(socket_path).start()
            step = 0
            client = monitor.client
            assert client is not None

            def one_step() -> bool:
                nonlocal step
                step += 1
                optimizer.zero_grad()
                model(torch.randn(4, 8)).pow(2).mean().backward()
                optimizer.step()
                monitor.log(step, loss=1.0)
                return client.connects > 0

            wait_for(one_step, 20, what="the late sidecar's first answer")
        said = deadweight_log.getvalue()
        assert "reachable again; run late-sidecar is monitored from here on" in said, said
        assert "unreachable" not in said
        assert "deadweight: run late-sidecar ended (completed)" in said
        assert "NOT monitored: no verdict" not in said
        assert late.seen("late-sidecar").ended
    finally:
        if late is not None:
            late.stop()


@pytest.mark.slow
def test_the_report_command_on_the_console_opens_the_report(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """The begin line's command is the sidecar's own, state dir included: pasted, it works."""
    state = tmp_path / "state dir"  # a space: the command must be quoted for a shell
    with SidecarProcess(tmp_path / "sc", extra_args=["--state-dir", str(state)]) as sc:
        lines, _ = _train(tiny, tmp_path / "frozen", "frozen", sc.address, "console-r1",
                          steps=4)
    begin = lines[_index(lines, "deadweight: run console-r1 reports to the sidecar at")]
    command = begin.split("open its report with: ", 1)[1].strip()
    assert command == f"deadweight report console-r1 --state-dir {shlex.quote(str(state))}"
    end = lines[_index(lines, "deadweight: run console-r1 ended")]
    assert end.endswith(f"report: {command}")
    page = tmp_path / "page.html"
    argv = [sys.executable, "-m", "deadweight.cli", *shlex.split(command)[1:], "--out",
            str(page)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "root cause empty_optimizer" in page.read_text()



def test_a_note_is_never_named_the_root_cause_nor_leads_the_summary() -> None:
    """A GRPO run with beta 0 carries ``no_kl_anchor`` (information) from step 0, read early in
    the cause order: a STOP for a constant reward still names the reward, and the summary at
    train end leads with what is wrong."""
    out = io.StringIO()
    logger = logging.getLogger("deadweight.test-note")
    logger.addHandler(logging.StreamHandler(out))
    logger.propagate = False
    console = Console(logger, "r", "unix:///s")
    console.begin(True, 1.0)
    note = pb.VerdictNotice(detector="no_kl_anchor", severity="info", incident=1, step=0,
                            cause="No anchor", fix="set beta", cause_rank=15)
    console.notices([note, _notice("zero_reward_variance", rank=23),
                     _notice("zero_gradient", rank=24)])
    firing = ["no_kl_anchor", "zero_reward_variance", "zero_gradient"]
    assert console.root_cause("zero_gradient", firing) == "zero_reward_variance"
    console.end(5, "completed", firing)
    summary = out.getvalue().splitlines()[-1]
    assert summary.split("root cause first: ")[1].startswith("zero_reward_variance ("), summary
    assert summary.index("zero_gradient (") < summary.index("no_kl_anchor (")
