"""Runs under attack and accident, against a real ``deadweight serve``: a second uid in the
socket's group and a second process of the same uid try to write to, end, lock out or blind a
real run; a run id is used again; a rank pre-sets its sequence numbers.

Every party is a real process (``tests/support/trust_client.py``), the second uid a real one
(``setpriv --reuid 12345``), and the outcome is read from the sidecar's answers, its
``/metrics`` and its journal.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.store.journal import Store
from tests.support.realprocs import wait_for
from tests.support.trust_party import Client

pytestmark = pytest.mark.slow

OTHER_UID = 12345


@pytest.fixture(scope="module")
def shared() -> Iterator[Path]:
    """A folder the second uid can traverse (pytest's own temp root is private)."""
    folder = Path(tempfile.mkdtemp(prefix="deadweight-trust-", dir="/tmp"))
    os.chmod(folder, 0o755)
    yield folder


def _sidecar(folder: Path, *extra: str) -> SidecarProcess:
    return SidecarProcess(folder, policies={"frozen_weights": "stop",
                                            "nonfinite_loss": "stop"},
                          extra_args=["--state-dir", str(folder / "state"), *extra],
                          watch_roots=[folder])


@pytest.fixture(scope="module")
def sidecar(shared: Path) -> Iterator[SidecarProcess]:
    """A sidecar that admits the second uid too (the harder case: by default only its own
    uid and root may report)."""
    with _sidecar(shared / "open", "--trainer-uid", "0", "--trainer-uid",
                  str(OTHER_UID)) as process:
        yield process


def _metric(process: SidecarProcess, name: str, **labels: str) -> float:
    for line in process.metrics().splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not on /metrics")


def _firing(process: SidecarProcess, run_id: str, detector: str) -> bool:
    status = process.run_status(run_id)
    return status is not None and any(f.detector == detector and f.firing
                                      for f in status.findings)


# -- item 1: unattested and foreign writes ---------------------------------------------------


def test_unattested_streams_are_refused_on_the_unix_socket(sidecar: SidecarProcess) -> None:
    """1a/1c: a second uid, and a same-uid process, without a nonce cannot register or
    write; the refusal is counted."""
    job = Client(sidecar, "job-1a")
    other = Client(sidecar, "job-1a", rank=1, uid=OTHER_UID, attest=False)
    same = Client(sidecar, "job-1a", rank=1, attest=False)
    try:
        assert not job.do(start={"seq": 1})["error"]
        for intruder in (other, same):
            answer = intruder.do(start={"seq": 1})
            assert "requires attestation" in answer["error"], answer
            answer = intruder.do(log={"loss": "nan"}, step=1, seq=2)
            assert "requires attestation" in answer["error"], answer
        assert not _firing(sidecar, "job-1a", "nonfinite_loss")
        assert _metric(sidecar, "deadweight_batches_refused_total", kind="attestation") >= 2
        assert _metric(sidecar, "deadweight_unattested_allowed") == 0
    finally:
        for client in (job, other, same):
            client.close()


def test_a_second_uid_that_attests_cannot_join_or_inject(sidecar: SidecarProcess) -> None:
    """1a: a second uid attesting as rank 1 of a running job is refused; its NaN never lands."""
    job = Client(sidecar, "job-foreign")
    intruder = Client(sidecar, "job-foreign", rank=1, uid=OTHER_UID)
    try:
        assert not job.do(start={"seq": 1})["error"]
        assert not job.do(steps=[1, 2], kind="healthy", seq=2)["error"]
        assert "same uid" in intruder.do(start={"seq": 1})["error"]
        intruder.do(log={"loss": "nan"}, step=3, seq=2)
        assert not _firing(sidecar, "job-foreign", "nonfinite_loss")
        assert not job.do(steps=[3, 3], kind="healthy", seq=6)["directives"]
    finally:
        job.close()
        intruder.close()


def test_a_same_uid_rank_cannot_end_the_run_or_set_its_logs(sidecar: SidecarProcess) -> None:
    """1b/3: another process of the job's uid, attested as rank 1, sends loss=NaN and a run
    end: only the rank that started the run sets run-wide logs and ends it."""
    job = Client(sidecar, "job-rank1")
    rank1 = Client(sidecar, "job-rank1", rank=1)
    try:
        assert not job.do(start={"seq": 1})["error"]
        assert not rank1.do(start={"seq": 1})["error"]
        assert not job.do(steps=[1, 8], kind="frozen", seq=2)["error"]
        wait_for(lambda: _firing(sidecar, "job-rank1", "frozen_weights"), what="frozen fires")
        assert not rank1.do(log={"loss": "nan"}, step=9, seq=2)["error"]
        assert not rank1.do(end="completed", seq=3)["error"]
        status = sidecar.run_status("job-rank1")
        assert status is not None and not status.ended  # the run goes on ...
        assert _firing(sidecar, "job-rank1", "frozen_weights")  # ... and so does its verdict
        assert not _firing(sidecar, "job-rank1", "nonfinite_loss")
        assert not job.do(end="completed", seq=18)["error"]  # the leader ends it
        status = sidecar.run_status("job-rank1")
        assert status is not None and status.ended
    finally:
        job.close()
        rank1.close()


# -- item 2: run ids used again, rebinding, sequence numbers ----------------------------------


def test_a_run_id_used_again_is_a_new_incarnation_and_its_frozen_steps_count(
    sidecar: SidecarProcess,
) -> None:
    """2a: a fixed run id, second train(): the second, frozen life gets its verdict."""
    first = Client(sidecar, "reused")
    try:
        assert not first.do(start={"seq": 1})["error"]
        assert not first.do(steps=[1, 30], kind="healthy", seq=2)["error"]
        assert not first.do(end="completed", seq=62)["error"]
    finally:
        first.close()
    before = _metric(sidecar, "deadweight_run_incarnations_total")
    second = Client(sidecar, "reused")
    try:
        assert not second.do(start={"seq": 1})["error"]
        answer = second.do(steps=[1, 30], kind="frozen", seq=2)
        assert not answer["error"] and answer["ack"] == 61  # no step was a duplicate
        wait_for(lambda: _firing(sidecar, "reused", "frozen_weights"), what="the frozen verdict")
        assert _metric(sidecar, "deadweight_run_incarnations_total") == before + 1
    finally:
        second.close()


def test_a_rank_pre_set_to_a_huge_sequence_number_drops_nothing_of_the_real_job(
    sidecar: SidecarProcess,
) -> None:
    """2b: a same-uid process registers rank 0 first with seq 2^62 and exits; the real job's
    RunStart rebinds the rank: a new incarnation, every real event counted."""
    squatter = Client(sidecar, "squatted")
    assert not squatter.do(start={"seq": 2**62})["error"]
    squatter.close()
    job = Client(sidecar, "squatted")
    try:
        assert not job.do(start={"seq": 1})["error"]
        answer = job.do(steps=[1, 10], kind="frozen", seq=2)
        assert not answer["error"] and answer["ack"] == 21
        wait_for(lambda: _firing(sidecar, "squatted", "frozen_weights"), what="frozen fires")
    finally:
        job.close()


def test_a_second_live_process_is_refused_and_the_first_keeps_its_run(
    sidecar: SidecarProcess,
) -> None:
    """2: two live processes of one uid with one run id (a job template's fixed id): the
    second is refused with a clear error and the run gets ``run_id_in_use``; the first keeps
    its rank, its verdicts and its stream (no turn-taking). Once the first exits, the second
    starts a new incarnation, and the old one's writes never steer it."""
    old = Client(sidecar, "rebound")
    new = Client(sidecar, "rebound")
    try:
        assert not old.do(start={"seq": 1})["error"]
        assert not old.do(steps=[1, 8], kind="frozen", seq=2)["error"]
        wait_for(lambda: _firing(sidecar, "rebound", "frozen_weights"), what="old life fires")
        refused = new.do(start={"seq": 1})
        assert "in use by another live process" in refused["error"], refused
        assert f"pid {old.proc.pid}" in refused["error"]
        assert "not monitored" in refused["error"]
        assert _firing(sidecar, "rebound", "run_id_in_use")
        assert _firing(sidecar, "rebound", "frozen_weights")  # the old life's verdict stays
        for _ in range(3):  # it keeps trying, as the callback does: still no turn-taking
            again = new.do(start={"seq": 1})
            assert "in use by another live process" in again["error"]
            kept = old.do(steps=[9, 9], kind="frozen", seq=18)
            assert not kept["error"], kept
        before = _metric(sidecar, "deadweight_run_incarnations_total")
        old.close()  # the owner exits
        wait_for(lambda: not new.do(start={"seq": 1})["error"], timeout=30,
                 what="the second process to take the run id once the first is gone")
        assert _metric(sidecar, "deadweight_run_incarnations_total") == before + 1
        assert not _firing(sidecar, "rebound", "frozen_weights")
        answer = new.do(steps=[1, 3], kind="healthy", seq=2)
        assert not answer["error"] and not answer["directives"]
        store = Store(sidecar.folder / "state")
        incidents = [i for i in store.incidents("rebound") if i.detector == "frozen_weights"]
        assert incidents and incidents[0].resolved_at is not None  # kept, closed
        assert {i.incarnation for i in incidents} == {1}
        assert store.bindings("rebound")[0].pid == new.proc.pid
        store.close()
    finally:
        old.close()
        new.close()


def test_a_second_uid_cannot_take_a_live_run_nor_lock_out_the_job_of_a_trainer_uid(
    shared: Path,
) -> None:
    """2c: with --trainer-uid (the Kubernetes manifest sets it), a second uid that attests
    first is refused, so it can neither hold the run id nor lock the real job out."""
    with _sidecar(shared / "uids", "--trainer-uid", "0") as process:
        squatter = Client(process, "locked", uid=OTHER_UID)
        job = Client(process, "locked")
        try:
            # Its .attest connection is closed unanswered: no nonce, so no RunStart.
            assert "requires attestation" in squatter.do(start={"seq": 1})["error"]
            assert not job.do(start={"seq": 1})["error"]
            answer = job.do(steps=[1, 10], kind="frozen", seq=2)
            assert not answer["error"] and answer["ack"] == 21
            wait_for(lambda: _firing(process, "locked", "frozen_weights"), what="frozen fires")
        finally:
            squatter.close()
            job.close()


def test_by_default_only_the_sidecars_own_uid_may_report(shared: Path) -> None:
    """9, default: without --trainer-uid a second uid that attests first is refused (it
    cannot hold the run id), the sidecar's own uid registers, and the startup line says so."""
    with _sidecar(shared / "default-uids") as process:
        squatter = Client(process, "default-locked", uid=OTHER_UID)
        job = Client(process, "default-locked")
        try:
            # Its .attest connection is closed unanswered: no nonce, so no RunStart.
            assert "requires attestation" in squatter.do(start={"seq": 1})["error"]
            assert not job.do(start={"seq": 1})["error"]
            assert not job.do(steps=[1, 2], kind="healthy", seq=2)["error"]
        finally:
            squatter.close()
            job.close()
        log = process.log_path.read_text()
    assert '"trainer_uids_from": "default"' in log, log
    assert f'"trainer_uids": [{os.geteuid()}]' in log, log


# -- the operator's opt-out, and runs that stop talking ----------------------------------------


def test_the_opt_out_is_visible_and_silent_runs_expire(shared: Path) -> None:
    """1/5: --allow-unattested shows in the log and on /metrics; unattested runs that stop
    talking end after --silent-run-seconds, so they cannot fill the run table for good."""
    with _sidecar(shared / "optout", "--allow-unattested", "--silent-run-seconds", "2",
                  "--max-runs", "3", "--run-ttl-seconds", "0") as process:
        assert "attestation_optional" in process.log_path.read_text()
        assert _metric(process, "deadweight_unattested_allowed") == 1
        squatters = [Client(process, f"silent-{i}", attest=False) for i in range(3)]
        try:
            for client in squatters:
                assert not client.do(start={"seq": 1})["error"]
            late = Client(process, "late", attest=False)
            try:
                def registered() -> bool:
                    return not late.do(start={"seq": 1})["error"]

                wait_for(registered, timeout=30, what="room once the silent runs expired")
            finally:
                late.close()
        finally:
            for client in squatters:
                client.close()


# -- item 7: scrapes while a sharded run steps -----------------------------------------------


def test_scrapes_never_fail_while_a_sharded_run_steps(sidecar: SidecarProcess) -> None:
    """7: two ranks of a sharded run step while /metrics is scraped in parallel: every
    scrape answers 200 (the exporter reads the run under the registry's lock)."""
    import threading
    import urllib.error
    import urllib.request

    ranks = [Client(sidecar, "sharded", rank=r) for r in (0, 1)]
    failures: list[str] = []
    scrapes = 0
    done = threading.Event()

    def scrape() -> None:
        nonlocal scrapes
        url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
        while not done.is_set():
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    assert response.status == 200
                    response.read()
            except (urllib.error.URLError, OSError, AssertionError) as err:
                failures.append(repr(err))
            scrapes += 1

    scrapers = [threading.Thread(target=scrape, daemon=True) for _ in range(4)]
    try:
        for client in ranks:
            assert not client.do(start={"seq": 1, "sharded": True})["error"]
        for thread in scrapers:
            thread.start()
        for batch in range(20):  # 200-step batches: the ranks' deques churn under scrapes
            for client in ranks:
                first = batch * 200 + 1
                assert not client.do(steps=[first, first + 199], kind="healthy",
                                     seq=2 + batch * 400)["error"]
            joiner = Client(sidecar, "sharded", rank=2 + batch)  # ranks join meanwhile
            assert not joiner.do(start={"seq": 1, "sharded": True})["error"]
            joiner.close()
    finally:
        done.set()
        for thread in scrapers:
            thread.join(60)
        for client in ranks:
            client.close()
    assert scrapes > 50 and not failures, (scrapes, failures[:3])


# -- item 4: a second uid names a folder only the sidecar can read ------------------------------


def test_a_second_uid_cannot_read_a_root_only_checkpoint_through_the_sidecar(
    sidecar: SidecarProcess, shared: Path,
) -> None:
    """4: another uid points output_dir (and a checkpoint report) at a root-only folder inside
    the watch root: refused with a finding, no file or tensor name leaks to Status or /metrics."""
    from tests.support.checkpoint_files import adapter as _adapter

    secret = shared / "open" / "root-only"
    _adapter(secret / "checkpoint-1")
    os.chmod(secret, 0o700)  # the second uid cannot even list it
    intruder = Client(sidecar, "peek", uid=OTHER_UID)
    try:
        assert not intruder.do(start={"seq": 1, "output_dir": str(secret)})["error"]
        wait_for(lambda: _firing(sidecar, "peek", "checkpoint_refused"), timeout=30,
             what="the refusal finding")
        status = sidecar.run_status("peek")
        assert status is not None
        finding = next(f for f in status.findings if f.detector == "checkpoint_refused")
        assert "owned by uid 0" in finding.evidence["reason"]
        text = sidecar.metrics()
        assert "lora_A" not in str(status) and "lora_A" not in text
        assert not any('run_id="peek"' in x for x in text.splitlines()
                       if x.startswith("deadweight_checkpoint_info"))
    finally:
        intruder.close()


def test_a_second_uid_that_pre_registers_never_steers_the_real_trainer(
    sidecar: SidecarProcess,
) -> None:
    """1a (no --trainer-uid): a second uid registers rank 1 of the job's run id before the job
    starts and sends loss=NaN. Its own run fires; the real trainer is refused loudly (never
    bound to the squatter's run) and gets no directive from it."""
    squatter = Client(sidecar, "prereg", rank=1, uid=OTHER_UID)
    job = Client(sidecar, "prereg")
    try:
        assert not squatter.do(start={"seq": 1})["error"]
        assert not squatter.do(log={"loss": "nan"}, step=1, seq=2)["error"]
        wait_for(lambda: _firing(sidecar, "prereg", "nonfinite_loss"), what="the squatter's run")
        answer = job.do(start={"seq": 1})
        assert f"uid {OTHER_UID}" in answer["error"], answer
        answer = job.do(steps=[1, 3], kind="healthy", seq=2)
        assert not answer.get("directives"), answer
        store = Store(sidecar.folder / "state")
        bound = store.bindings("prereg")
        store.close()
        assert {identity.uid for identity in bound.values()} == {OTHER_UID}
        assert job.proc.pid not in {identity.pid for identity in bound.values()}
    finally:
        squatter.close()
        job.close()
