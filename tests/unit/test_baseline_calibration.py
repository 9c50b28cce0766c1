"""A baseline quiets a fixed detector on what healthy runs of its recipe did, never more:
``rank_straggler`` on a job whose ranks do unequal work by design, end to end through the
registry, its state database and ``baseline.build``."""

from __future__ import annotations

from pathlib import Path

from deadweight.proto import pb
from deadweight.sidecar.baseline.build import build
from deadweight.sidecar.baseline.model import Baseline
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import RANKS, Store

#: Rank 1 reads a shard about 1.8x rank 0's: its own seconds per step, by design.
BY_DESIGN = [(0.10, 0.18 + 0.01 * (step % 3)) for step in range(1, 13)]


def _job(registry: Registry, run_id: str, times: list[tuple[float, float]],
         baseline: Baseline | None = None) -> None:
    """A two-rank job, each rank reporting its own seconds of every step."""
    seq = {0: 0, 1: 0}

    def send(rank: int, **body: object) -> None:
        seq[rank] += 1
        registry.ingest(pb.StreamRequest(run_id=run_id, rank=rank, events=[
            pb.Event(seq=seq[rank], **body)]))  # type: ignore[arg-type]

    named = {} if baseline is None else {"baseline": baseline.to_json(),
                                         "baseline_name": "ranks.baseline.json"}
    for rank in (0, 1):
        send(rank, run_start=pb.RunStart(trainer="SFTTrainer", world_size=2,
                                         config={"learning_rate": 1e-4}, **named))
    for step, pair in enumerate(times, start=1):
        for rank, seconds in enumerate(pair):
            send(rank, step=pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=1e-6,
                                          watched_params=8, optimizer_params=8,
                                          watched_tensors=2, local_seconds=seconds))


def _straggler(registry: Registry, run_id: str) -> dict[str, str] | None:
    finding = registry.findings(run_id).get("rank_straggler")
    return dict(finding.evidence) if finding is not None and finding.incidents else None


def test_a_baseline_raises_the_straggler_ratio_to_its_healthy_ranks_and_no_further(
        tmp_path: Path) -> None:
    store = Store(tmp_path)
    try:
        registry = Registry(settings=DetectorSettings(), store=store)
        _job(registry, "ranks-0", BY_DESIGN)
        assert _straggler(registry, "ranks-0") is not None  # the fixed 1.5 fires on it
        timed = store.history("ranks-0", RANKS)
        assert [s for s, _, _ in timed] == list(range(1, 13))  # every step both ranks timed
        assert timed[0][2]["slowest_over_next"] == BY_DESIGN[0][1] / BY_DESIGN[0][0]
        baseline = build(store, ["ranks-0"])
        assert baseline.rank_time_ratio is not None and 1.8 < baseline.rank_time_ratio < 2.0
        again = Baseline.from_json(baseline.to_json())
        assert again.rank_time_ratio == baseline.rank_time_ratio

        _job(registry, "ranks-1", BY_DESIGN, baseline)  # the recipe's own imbalance
        assert _straggler(registry, "ranks-1") is None
        slower = [(0.10, 0.40)] * 12  # rank 1 at 4x: beyond anything healthy runs showed
        _job(registry, "ranks-slow", slower, baseline)
        fired = _straggler(registry, "ranks-slow")
        assert fired is not None and fired["rank"] == "1"
        assert float(fired["baseline_ratio"]) > DetectorSettings().straggler_ratio
    finally:
        store.close()


def test_a_balanced_baseline_never_lowers_the_fixed_ratio(tmp_path: Path) -> None:
    """Healthy ranks within 5% of each other: the baseline's ratio is 1.05, and a rank
    1.3x slower (under the fixed 1.5) still draws nothing."""
    store = Store(tmp_path)
    try:
        registry = Registry(settings=DetectorSettings(), store=store)
        _job(registry, "even-0", [(0.20, 0.21)] * 12)
        baseline = build(store, ["even-0"])
        assert baseline.rank_time_ratio is not None and baseline.rank_time_ratio < 1.1
        _job(registry, "even-1", [(0.20, 0.26)] * 12, baseline)
        assert _straggler(registry, "even-1") is None
        _job(registry, "even-2", [(0.20, 0.32)] * 12, baseline)  # 1.6x: the fixed bar fires
        fired = _straggler(registry, "even-2")
        assert fired is not None and "baseline_ratio" not in fired
    finally:
        store.close()
