"""Boundaries of the per-rank and rollout detectors, fed as wire events into a real Registry.

The real runs (``test_ranks``, ``test_rollout_staleness``) prove each detector on the failure;
these pin what must not alarm: ranks that are all inside a long step, noise in the ranks'
timings, replicas equal to rounding, other tensors on another rank (pipeline stages), sharded
runs, a run that samples with truncation from its first step.
"""

from __future__ import annotations

import pytest

from deadweight.proto import pb
from deadweight.sidecar.commands import status
from deadweight.sidecar.exposition.collector import DeadweightCollector
from deadweight.sidecar.exposition.http import render
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Registry


class Ranks:
    """One run of several ranks on a registry, fed event by event."""

    def __init__(self, registry: Registry, ranks: int = 2, sharded: bool = False) -> None:
        self.registry, self.seq = registry, dict.fromkeys(range(ranks), 0)
        for rank in range(ranks):
            self.send(rank, run_start=pb.RunStart(trainer="SFTTrainer", world_size=ranks,
                                                  sharded=sharded))

    def send(self, rank: int, **body: object) -> pb.StreamResponse:
        self.seq[rank] += 1
        seq = 0 if "heartbeat" in body else self.seq[rank]  # heartbeats carry no seq
        event = pb.Event(seq=seq, **body)  # type: ignore[arg-type]
        return self.registry.ingest(pb.StreamRequest(run_id="r", rank=rank, events=[event]))

    def step(self, rank: int, step: int, local: float | None = None) -> None:
        report = pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=1e-6,
                               watched_params=8, optimizer_params=8, watched_tensors=2)
        if local is not None:
            report.local_seconds = local
        self.send(rank, step=report)

    def began(self, rank: int, step: int) -> None:
        self.send(rank, heartbeat=pb.Heartbeat(step=step - 1, began_step=step))

    def replica(self, rank: int, step: int, values: list[float], structure: str = "s",
                names: tuple[str, ...] = ("a.weight", "b.weight")) -> pb.StreamResponse:
        half = len(values) // 2
        return self.send(rank, replica=pb.ReplicaDigest(
            step=step, structure=structure, values=values, sizes=[half, len(values) - half],
            names=list(names)))

    def finding(self, detector: str) -> object | None:
        return self.registry.findings("r").get(detector)

    def firing(self, detector: str) -> bool:
        finding = self.registry.findings("r").get(detector)
        return finding is not None and finding.firing


STALL = DetectorSettings(rank_stalled_seconds=60)


def _stalled_at_3() -> Ranks:
    feed = Ranks(Registry(settings=STALL))
    for rank in (0, 1):
        for step in (1, 2, 3):
            feed.step(rank, step)
    return feed


def _age(feed: Ranks, seconds: float, silent: tuple[int, ...] = ()) -> None:
    """Move the run's past back by seconds: its steps and step begins, and the last messages
    of the silent ranks (the others have just sent one)."""
    run = feed.registry.run("r")
    assert run is not None
    for rank in run.ranks.values():
        rank.last_step_time -= seconds
        rank.began_time -= seconds
        if rank.rank in silent:
            rank.last_seen -= seconds


def test_rank_stalled_names_the_rank_that_never_began_the_step() -> None:
    feed = _stalled_at_3()
    feed.began(0, 4)  # rank 0 is inside step 4 (waiting); rank 1 never began it
    feed.began(1, 3)
    _age(feed, 30)
    feed.registry.tick()
    assert not feed.firing("rank_stalled")  # within the limit
    _age(feed, 31)
    feed.registry.tick()
    finding = feed.registry.findings("r")["rank_stalled"]
    assert finding.firing and finding.evidence["rank"] == "1"
    # Rank 1 still beats: alive in its own code, as a long rank-only save would be.
    assert finding.severity == "warning"
    assert finding.evidence["last_step"] == "3" and finding.evidence["waiting_in_step"] == "4"
    assert "rank 1 stopped after step 3" in finding.summary
    assert float(finding.evidence["seconds"]) >= 61
    feed.step(1, 4)  # rank 1 goes on: the verdict clears
    feed.step(0, 4)
    feed.registry.tick()
    assert not feed.firing("rank_stalled")


def test_every_rank_inside_a_long_step_is_not_a_stuck_rank() -> None:
    feed = _stalled_at_3()
    for rank in (0, 1):
        feed.began(rank, 4)
    _age(feed, 600)
    feed.registry.tick()
    assert feed.finding("rank_stalled") is None


def test_rank_stalled_names_a_silent_rank_while_the_other_reports() -> None:
    feed = _stalled_at_3()
    _age(feed, 61, silent=(0, 1))
    feed.registry.tick()
    assert feed.finding("rank_stalled") is None  # every rank silent: the run's stall
    feed.began(0, 4)  # rank 0 reports again; rank 1's process froze after step 3
    feed.registry.tick()
    finding = feed.registry.findings("r")["rank_stalled"]
    assert finding.firing and finding.evidence["rank"] == "1"
    assert finding.severity == "critical"  # silent while rank 0 reports: gone or frozen
    assert "never began step 4" in finding.summary
    feed.began(1, 4)  # rank 1 got to step 4 (it began it), then went silent inside it
    feed.began(0, 4)
    _age(feed, 61, silent=(1,))
    feed.registry.tick()
    finding = feed.registry.findings("r")["rank_stalled"]
    assert finding.firing and finding.evidence["rank"] == "1"
    assert "sent nothing" in finding.summary


STRAGGLE = DetectorSettings(straggler_steps=6)


def test_straggler_needs_a_consistent_and_large_lead() -> None:
    feed = Ranks(Registry(settings=STRAGGLE))
    noisy = [(0.10, 0.12), (0.13, 0.10), (0.11, 0.12), (0.12, 0.10), (0.10, 0.13), (0.12, 0.11)]
    for step, (a, b) in enumerate(noisy, start=1):
        feed.step(0, step, a)
        feed.step(1, step, b)
    assert feed.finding("rank_straggler") is None  # noise: neither rank always the slowest
    tiny = Ranks(Registry(settings=STRAGGLE))
    for step in range(1, 7):  # twice as slow, but 4 ms: below straggler_min_seconds
        tiny.step(0, step, 0.004)
        tiny.step(1, step, 0.008)
    assert tiny.finding("rank_straggler") is None
    slow = Ranks(Registry(settings=STRAGGLE))
    for step in range(1, 7):
        slow.step(0, step, 0.10)
        slow.step(1, step, 0.25)
    finding = slow.registry.findings("r")["rank_straggler"]
    assert finding.firing and finding.evidence["rank"] == "1" and finding.step == 6
    assert finding.policy == "observe"


def test_replicas_equal_to_the_bit_or_rounding_are_silent_apart_they_fire() -> None:
    feed = Ranks(Registry())
    feed.replica(0, 1, [0.5, -0.25, 1.0, 2.0])
    feed.replica(1, 1, [0.5, -0.25, 1.0, 2.0 * (1 + 1e-7)])
    assert feed.finding("replicas_diverged") is None
    feed.replica(0, 2, [0.5, -0.25, 1.0, 2.0])
    feed.replica(1, 2, [0.5, -0.25, 1.1, 2.0])
    finding = feed.registry.findings("r")["replicas_diverged"]
    assert finding.firing and finding.step == 2
    assert finding.evidence["tensors_apart"] == "1/2" and finding.evidence["tensor"] == "b.weight"


def test_replicas_apart_by_less_than_a_step_are_a_warning_by_more_critical() -> None:
    """Each step moves the weights by 1e-3 of their norm. Ranks 1e-4 apart (beyond the
    tolerance, less than one step: kernels that round differently can drift that far) are a
    warning; ranks a whole step apart applied different updates: critical."""
    feed = Ranks(Registry())
    for rank in (0, 1):
        feed.send(rank, step=pb.StepReport(step=1, learning_rate=1e-4, update_sq_sum=1e-6,
                                           param_sq_sum=1.0, watched_params=4,
                                           optimizer_params=4, watched_tensors=2))
    base = [0.6, 0.0, 0.8, 0.0]  # each tensor's norm: 0.6 and 0.8
    feed.replica(0, 1, base)
    feed.replica(1, 1, [0.6, 0.0, 0.8, 0.8e-4])
    drift = feed.registry.findings("r")["replicas_diverged"]
    assert drift.firing and drift.severity == "warning"
    assert drift.evidence["step_relative_update"] == "0.001"
    feed.replica(0, 2, base)
    feed.replica(1, 2, [0.6, 0.0, 0.8, 0.8e-2])
    apart = feed.registry.findings("r")["replicas_diverged"]
    assert apart.firing and apart.severity == "critical" and apart.step == 2


def test_other_tensors_on_another_rank_and_sharded_runs_are_not_compared() -> None:
    stages = Ranks(Registry())  # pipeline stages: each rank holds other tensors
    stages.replica(0, 1, [0.5, 1.0], structure="stage0")
    stages.replica(1, 1, [3.0, 4.0], structure="stage1", names=("c.weight", "d.weight"))
    assert stages.finding("replicas_diverged") is None
    sharded = Ranks(Registry(), sharded=True)
    sharded.replica(0, 1, [0.5, 1.0])
    sharded.replica(1, 1, [3.0, 4.0])
    assert sharded.finding("replicas_diverged") is None


def test_a_replica_sample_whose_sizes_do_not_add_up_is_refused() -> None:
    feed = Ranks(Registry())
    response = feed.send(0, replica=pb.ReplicaDigest(step=1, structure="s", values=[1.0, 2.0],
                                                     sizes=[5], names=["a"]))
    assert "do not add up" in response.error
    run = feed.registry.run("r")
    assert run is not None and not run.ranks[0].replicas


def _rollout(values: list[float]) -> Ranks:
    feed = Ranks(Registry(), ranks=1)
    for step, value in enumerate(values, start=1):
        feed.send(0, log=pb.LogReport(step=step, values={
            "sampling/sampling_logp_difference/mean": value,
            "sampling/importance_sampling_ratio/mean": 1.0}))
    return feed


def test_rollout_stale_against_the_run_s_own_start() -> None:
    # Truncated sampling (top_p 0.8) starts near 0.11 and stays there: its normal.
    assert _rollout([0.11, 0.112, 0.108, 0.11, 0.113, 0.109]).finding("rollout_stale") is None
    # An engine stale from the first step: far above any sampling setting.
    stale = _rollout([0.8, 0.81, 0.79])
    assert stale.firing("rollout_stale")
    # A rise of the same size as noise on a tiny baseline stays under the absolute floor.
    assert _rollout([0.01, 0.012, 0.011, 0.05, 0.06, 0.07]).finding("rollout_stale") is None
    rising = _rollout([0.015, 0.016, 0.015, 0.12, 0.15])
    assert not rising.firing("rollout_stale")  # two reports above the limit: not yet
    rising.send(0, log=pb.LogReport(step=6, values={
        "sampling/sampling_logp_difference/mean": 0.2}))
    assert rising.registry.findings("r")["rollout_stale"].step == 6


PHASE = pb.Heartbeat.Phase
#: The issue's configuration: the run's stall after 10 s, the per-rank verdict at its default.
STALL_10 = DetectorSettings(stalled_step_seconds=10)


def _phase(feed: Ranks, rank: int, step: int, phase: int, ago: float = 0.0,
           where: str = "") -> None:
    feed.send(rank, heartbeat=pb.Heartbeat(step=step - (phase != PHASE.PHASE_OPTIMIZER_STEP),
                                           phase=phase, phase_step=step,  # type: ignore[arg-type]
                                           phase_seconds_ago=ago, where=where))


def _age_all(feed: Ranks, seconds: float) -> None:
    """Move every clock of the run back by seconds (the ranks still send heartbeats)."""
    run = feed.registry.run("r")
    assert run is not None
    for rank in run.ranks.values():
        rank.last_step_time -= seconds
        rank.began_time -= seconds
        rank.first_seen -= seconds
        rank.phase_time -= seconds
        rank.phase_times = {p: t - seconds for p, t in rank.phase_times.items()}


def _hung(first: tuple[int, int], second: tuple[int, int]) -> Ranks:
    """Both ranks made optimizer steps 1-5; then rank 0 got to ``first`` (step, phase) and
    rank 1 to ``second``, and nothing moved for 12 s."""
    feed = Ranks(Registry(settings=STALL_10))
    for step in range(1, 6):
        for rank in (0, 1):
            feed.step(rank, step)
    _phase(feed, 0, *first, where="collective")
    _phase(feed, 1, *second, where="rank_worker.py:120 run")
    _age_all(feed, 12)
    places = ("collective", "rank_worker.py:120 run")
    for rank, (step, phase) in enumerate((first, second)):  # heartbeats go on
        _phase(feed, rank, step, phase, ago=12, where=places[rank])
    feed.registry.tick()
    return feed


def test_stalled_names_the_rank_that_stopped_first_with_its_phase() -> None:
    """The issue's job: both ranks' last optimizer step is 5; rank 0 began step 6 and waits in
    its gradient sync, rank 1 never began it. The run's stall names rank 1, where and since
    when (the per-rank verdict, at its 300 s default, has not spoken yet)."""
    feed = _hung((6, PHASE.PHASE_BACKWARD_DONE), (5, PHASE.PHASE_OPTIMIZER_STEP))
    finding = feed.registry.findings("r")["stalled"]
    assert finding.firing
    assert finding.evidence["rank"] == "1" and finding.evidence["stuck_ranks"] == "1"
    assert finding.evidence["phase"] == "optimizer_step"
    assert finding.evidence["phase_step"] == "5"
    assert float(finding.evidence["stopped_seconds"]) >= 12
    assert finding.evidence["waiting_ranks"] == "0"
    assert finding.evidence["waiting_phase"] == "backward_done"
    assert finding.evidence["waiting_phase_step"] == "6"
    assert "rank 1 stopped first, at optimizer step 5, 12 s ago" in finding.summary
    assert "never began step 6" in finding.summary
    assert not feed.firing("rank_stalled")
    # What on-call reads: the status line and the /metrics page (which nodes' Prometheus
    # compares across sidecars).
    text = status.render(feed.registry.status())
    assert "rank = 1" in text and "phase = optimizer_step" in text
    page = render(DeadweightCollector(feed.registry, None,
                                      feed.registry.detectors).exposition()).decode()
    assert 'deadweight_rank_progress_steps{rank="1",run_id="r",trainer="SFTTrainer"} 5.0' \
        in page
    assert 'deadweight_rank_progress_steps{rank="0",run_id="r",trainer="SFTTrainer"} 5.75' \
        in page
    assert ('deadweight_rank_phase_timestamp_seconds{phase="backward_done",rank="0",'
            'run_id="r",trainer="SFTTrainer"}') in page
    feed.step(1, 6)  # rank 1 goes on: the run moves, the stall clears
    feed.step(0, 6)
    feed.registry.tick()
    assert not feed.firing("stalled")


def test_stalled_orders_phases_inside_one_step() -> None:
    """Rank 0 still in step 6's forward pass while rank 1 waits after its backward: rank 0."""
    feed = _hung((6, PHASE.PHASE_FORWARD), (6, PHASE.PHASE_BACKWARD_DONE))
    finding = feed.registry.findings("r")["stalled"]
    assert finding.firing and finding.evidence["rank"] == "0"
    assert finding.evidence["phase"] == "forward"
    assert "the forward pass of step 6" in finding.summary


def test_stalled_names_no_rank_when_every_rank_stopped_alike() -> None:
    """Every rank at the same mark, none in a collective (an evaluation, a hang they share):
    the run's stall is reported without blaming a rank."""
    feed = Ranks(Registry(settings=STALL_10))
    for step in range(1, 6):
        for rank in (0, 1):
            feed.step(rank, step)
    for rank in (0, 1):
        _phase(feed, rank, 5, PHASE.PHASE_OPTIMIZER_STEP, where="trainer.py:10 evaluate")
    _age_all(feed, 12)
    for rank in (0, 1):
        _phase(feed, rank, 5, PHASE.PHASE_OPTIMIZER_STEP, ago=12, where="trainer.py:10 evaluate")
    feed.registry.tick()
    finding = feed.registry.findings("r")["stalled"]
    assert finding.firing and "rank" not in finding.evidence
    assert "every rank here (0,1) stopped at optimizer step 5" in finding.summary


def test_rank_stalled_names_the_rank_behind_in_phase() -> None:
    """The per-rank verdict reads the phases too: rank 1 stopped in step 6's forward pass
    while rank 0 waits after its backward, past rank_stalled_seconds."""
    feed = Ranks(Registry(settings=STALL))
    for step in (1, 2, 3):
        for rank in (0, 1):
            feed.step(rank, step)
    _phase(feed, 0, 4, PHASE.PHASE_BACKWARD_DONE, where="collective")
    _phase(feed, 1, 4, PHASE.PHASE_FORWARD, where="model.py:5 forward")
    _age_all(feed, 61)
    _phase(feed, 0, 4, PHASE.PHASE_BACKWARD_DONE, ago=61, where="collective")
    _phase(feed, 1, 4, PHASE.PHASE_FORWARD, ago=61, where="model.py:5 forward")
    feed.registry.tick()
    finding = feed.registry.findings("r")["rank_stalled"]
    assert finding.firing and finding.evidence["rank"] == "1"
    assert finding.evidence["phase"] == "forward" and finding.evidence["waiting_in_step"] == "4"
    assert "the forward pass of step 4" in finding.summary


def _timed(local: list[tuple[float, float]], step_seconds: float | None = None) -> Ranks:
    """A 2-rank run whose steps carry each rank's local seconds (and the step time)."""
    feed = Ranks(Registry(settings=DetectorSettings(straggler_steps=8)))
    for step, pair in enumerate(local, start=1):
        for rank, seconds in enumerate(pair):
            report = pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=1e-6,
                                   watched_params=8, optimizer_params=8, watched_tensors=2,
                                   local_seconds=seconds)
            if step_seconds is not None:
                report.step_seconds = step_seconds
            feed.send(rank, step=report)
    return feed


def test_straggler_is_judged_step_by_step_not_by_medians() -> None:
    """A rank preempted in some steps only (a CPU hog beside the job lands on it now and then):
    its median is 3.2x the other's and it is the slowest in every step, but it leads by the
    ratio in 5 of 8 steps: no rank the job waits for step after step."""
    hog = [(0.05, 0.16), (0.05, 0.16), (0.05, 0.06), (0.05, 0.06), (0.05, 0.06),
           (0.05, 0.16), (0.05, 0.16), (0.05, 0.16)]
    feed = _timed(hog)
    finding = feed.finding("rank_straggler")
    assert finding is None or not feed.firing("rank_straggler"), finding
    slow = _timed([(0.05, 0.16)] * 8)  # the same lead in every step: named
    assert slow.firing("rank_straggler")
    assert slow.registry.findings("r")["rank_straggler"].evidence["slowest_in_steps"] == "8/8"


def test_straggler_is_judged_against_the_job_step_time() -> None:
    """The same 0.1 s lead is nothing in a 2 s step (5%) and most of a 0.3 s one (33%)."""
    long_steps = _timed([(0.05, 0.15)] * 8, step_seconds=2.0)
    assert not long_steps.firing("rank_straggler")
    short_steps = _timed([(0.05, 0.15)] * 8, step_seconds=0.3)
    finding = short_steps.registry.findings("r")["rank_straggler"]
    assert finding.firing and finding.evidence["rank"] == "1"
    assert float(finding.evidence["share_of_step"]) == pytest.approx(1 / 3)
    assert "33% of the job's 0.3 s step" in finding.summary
