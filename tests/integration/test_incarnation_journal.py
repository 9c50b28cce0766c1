"""One run id, two lives, and a sidecar restarted between and during them: each life's
journal rows (history, checkpoints, verdicts, actions) stay its own, in the store, in the
checkpoint chain a restarted sidecar compares, in ``deadweight report`` and ``deadweight
runs``.

A job template's fixed ``DEADWEIGHT_RUN_ID`` (or a relaunch) starts its steps at 1 again:
keyed by run id alone, the second life's steps replaced the first's in the report's history,
and a restart handed the second life the first one's checkpoints to compare against. Every
party is a real process (``tests/support/trust_party.py``) against a real ``deadweight
serve`` with a state dir; the checkpoints are real adapter files the watcher reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.checkpoints.inspector import inspect_path
from deadweight.sidecar.store.journal import Store
from tests.support.checkpoint_files import adapter
from tests.support.realprocs import wait_for
from tests.support.trust_party import Client

pytestmark = pytest.mark.slow

RUN = "relaunched"


def _sidecar(folder: Path) -> SidecarProcess:
    return SidecarProcess(folder, extra_args=["--state-dir", str(folder / "state")],
                          watch_roots=[folder])


def _firing(process: SidecarProcess, detector: str) -> bool:
    status = process.run_status(RUN)
    return status is not None and any(f.detector == detector and f.firing
                                      for f in status.findings)


def _inspected(process: SidecarProcess, path: Path, since: int) -> bool:
    """Whether the sidecar's log, past byte ``since``, says it read path's files."""
    with process.log_path.open("rb") as log:
        log.seek(since)
        lines = log.read().decode(errors="replace").splitlines()
    for raw in lines:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("event") == "checkpoint_inspected" and (
                line.get("path") == str(path)):
            return True
    return False


def _save(process: SidecarProcess, client: Client, folder: Path, step: int, seq: int) -> None:
    """Write an adapter folder (the same bytes every time) and report it as on_save does;
    wait until the watcher read it."""
    since = process.log_path.stat().st_size
    files = inspect_path(adapter(folder))  # what the callback's in-memory digest says too
    digest = {"combined": files.adapter_digest, "tensors": files.tensor_digests,
              "bytes": files.tensor_bytes}
    assert not client.do(checkpoint={"step": step, "path": str(folder), "digest": digest},
                         seq=seq)["error"]
    wait_for(lambda: _inspected(process, folder, since), 30, what=f"{folder.name} inspected")


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadweight.cli", *argv], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_two_lives_of_one_run_id_never_mix_across_restarts(tmp_path: Path) -> None:
    folder, out = tmp_path / "sc", tmp_path / "sc" / "out"
    # Life 1: frozen steps 1..8, a checkpoint at step 4, then the run ends.
    with _sidecar(folder) as sidecar:
        first = Client(sidecar, RUN)
        try:
            assert not first.do(start={"seq": 1, "output_dir": str(out)})["error"]
            assert not first.do(steps=[1, 8], kind="frozen", seq=2)["error"]
            wait_for(lambda: _firing(sidecar, "frozen_weights"), what="life 1's verdict")
            _save(sidecar, first, out / "checkpoint-4", 4, seq=18)
            assert not first.do(end="completed", seq=19)["error"]
        finally:
            first.close()

    # The sidecar restarts; the same run id starts again (a relaunch): a healthy life 2,
    # whose steps 1..6 are the same numbers as life 1's.
    with _sidecar(folder) as sidecar:
        second = Client(sidecar, RUN)
        try:
            assert not second.do(start={"seq": 1, "output_dir": str(out)})["error"]
            assert not second.do(steps=[1, 6], kind="healthy", seq=2)["error"]
            assert not _firing(sidecar, "frozen_weights")
            sidecar.stop()  # restarted again while life 2 is live
            sidecar.start()
            # The callback re-sends its RunStart on a new stream; the process is the same,
            # so the life goes on (no third incarnation).
            wait_for(lambda: not second.do(start={"seq": 1, "output_dir": str(out)})["error"],
                     30, what="life 2 back on the restarted sidecar")
            assert not second.do(steps=[7, 8], kind="healthy", seq=14)["error"]
            # Life 2 writes the very bytes life 1 saved at step 4. Compared with life 1's
            # chain it would be "unchanged since step 4"; its own chain has nothing before.
            _save(sidecar, second, out / "checkpoint-8", 8, seq=18)
            assert not _firing(sidecar, "checkpoint_unchanged")
            assert not _firing(sidecar, "frozen_weights")
            # Control: the same bytes again within life 2 are unchanged, and say so.
            assert not second.do(steps=[9, 10], kind="healthy", seq=19)["error"]
            _save(sidecar, second, out / "checkpoint-10", 10, seq=23)
            wait_for(lambda: _firing(sidecar, "checkpoint_unchanged"), 30,
                     what="life 2's own unchanged checkpoint")
            assert not second.do(end="completed", seq=24)["error"]
            live = _cli("runs", "--address", sidecar.address, "--json")
            assert live.returncode == 0, live.stderr
            # The live sidecar says which life it holds: the second one.
            assert [r["incarnation"] for r in json.loads(live.stdout)["runs"]
                    if r["run_id"] == RUN] == [2]
        finally:
            second.close()

    store = Store(folder / "state")
    try:
        assert store.incarnations(RUN) == [1, 2]
        life1, life2 = store.history(RUN, "step", 1), store.history(RUN, "step", 2)
        assert [s for s, _, _ in life1] == list(range(1, 9))
        assert all(f["update_norm"] == 0.0 for _, _, f in life1)  # not replaced by life 2
        assert [s for s, _, _ in life2] == list(range(1, 11))
        assert all(f["update_norm"] > 0.0 for _, _, f in life2)
        assert [c.path for c in store.checkpoints(RUN, 1)] == [str(out / "checkpoint-4")]
        assert [c.path for c in store.checkpoints(RUN, 2)] == [
            str(out / "checkpoint-8"), str(out / "checkpoint-10")]
        assert {i.detector for i in store.incidents(RUN, 2)}.isdisjoint({"frozen_weights"})
        assert "frozen_weights" in {i.detector for i in store.incidents(RUN, 1)}
        assert all(a.incarnation == 1 for a in store.actions(RUN, "frozen_weights"))
    finally:
        store.close()

    state = str(folder / "state")
    listed = _cli("runs", "--state-dir", state, "--json")
    assert listed.returncode == 0, listed.stderr
    lines = [r for r in json.loads(listed.stdout)["runs"] if r["run_id"] == RUN]
    assert [r["incarnation"] for r in lines] == [1, 2]
    verdicts = [{v["detector"] for v in r["verdicts"]} for r in lines]
    assert "frozen_weights" in verdicts[0] and "checkpoint_unchanged" not in verdicts[0]
    assert "frozen_weights" not in verdicts[1] and "checkpoint_unchanged" in verdicts[1]
    table = _cli("runs", "--state-dir", state)
    assert f"{RUN} #2" in table.stdout, table.stdout

    pages = {}
    for life in ("", "1"):
        page = tmp_path / f"life{life or 'newest'}.html"
        made = _cli("report", RUN, "--state-dir", state, "--out", str(page),
                    *(["--incarnation", life] if life else []))
        assert made.returncode == 0, made.stderr
        pages[life or "newest"] = page.read_text()
    newest, older = pages["newest"], pages["1"]
    assert "incarnation 2" in newest and "<td>frozen_weights</td>" not in newest
    assert str(out / "checkpoint-8") in newest and str(out / "checkpoint-4") not in newest
    assert "<td>frozen_weights</td>" in older and str(out / "checkpoint-8") not in older
    assert str(out / "checkpoint-4") in older
    missing = _cli("report", RUN, "--state-dir", state, "--incarnation", "3", "--out",
                   str(tmp_path / "none.html"))
    assert missing.returncode == 2 and "has 1, 2" in missing.stderr, missing.stderr


def test_an_on_call_stop_belongs_to_the_life_it_stopped(tmp_path: Path) -> None:
    """``deadweight stop`` on life 1, then the run id starts again: life 2 is not "already
    stopped", gets its own STOP when on-call asks, and its status lists only its own."""
    folder = tmp_path / "sc"
    with _sidecar(folder) as sidecar:
        first = Client(sidecar, RUN)
        try:
            assert not first.do(start={"seq": 1})["error"]
            assert not first.do(steps=[1, 2], kind="healthy", seq=2)["error"]
            stopped = _cli("stop", RUN, "--reason", "life one", "--address", sidecar.address)
            assert "STOP queued" in stopped.stdout, stopped.stdout + stopped.stderr
            assert "ACTION_STOP" in first.do(steps=[3, 3], kind="healthy", seq=6)["directives"]
            assert not first.do(end="stopped", seq=8)["error"]
        finally:
            first.close()
        second = Client(sidecar, RUN)
        try:
            assert not second.do(start={"seq": 1})["error"]
            assert not second.do(steps=[1, 2], kind="healthy", seq=2)["error"]
            status = sidecar.run_status(RUN)
            assert status is not None and not [a for a in status.actions
                                                if a.detector == "operator"]
            again = _cli("stop", RUN, "--reason", "life two", "--address", sidecar.address)
            assert "STOP queued" in again.stdout, again.stdout + again.stderr
            assert "ACTION_STOP" in second.do(steps=[3, 3], kind="healthy", seq=6)[
                "directives"]
            status = sidecar.run_status(RUN)
            assert status is not None
            assert len([a for a in status.actions if a.detector == "operator"]) == 1
        finally:
            second.close()
    store = Store(folder / "state")
    try:
        rows = store.actions(RUN, "operator")
        assert [(r.incarnation, r.detail["reason"]) for r in rows] == [
            (1, "life one"), (2, "life two")]
    finally:
        store.close()
