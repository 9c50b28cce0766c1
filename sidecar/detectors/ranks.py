"""Detectors across the ranks of one run: a rank stuck while the others wait, a rank the others
consistently wait for, and replicas of the same weights that disagree.

Each rank is judged against the others, from what each reported of itself: the step its loop
began (heartbeats), its own seconds of work per step (step reports) and a fixed sample of its
replicated weights (replica digests). A run of one rank gives none of them.
"""

from __future__ import annotations

import math
import statistics
import time

from ..baseline.calibrate import straggler_ratio
from ..baseline.quantities import point_value
from ..model.run_state import RankState, ReplicaSample, RunState
from ..model.settings import DetectorSettings
from .base import SpecDetector, Verdict, fmt
from .spec import DetectorSpec, Evidence, Policy, Severity, Threshold
from .stopped_first import evidence, since, stopped_first, why


class RankStalled(SpecDetector):
    """One rank stopped while the others wait for it: named, with its last step and seconds.

    Ranks of a synchronised job finish each optimizer step together, so the last step alone
    cannot tell the stuck rank from the ranks blocked in the next collective. The step each
    rank's loop *began* can: the waiting ranks began the next step, the stuck one never did.
    Where the waiting ranks block before a step begins (the trainer gathers the batch's token
    count first), the heartbeats' description of each training thread does: the waiting ones
    are inside a collective, the stuck one is not. A rank that went silent while the others
    still report is named the same way.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin",
                         "ddp-gloo-2-ranks", "every-rank-in-a-long-step"),
        false_positives=("none known at critical: a rank silent for the window while the "
                         "others report is gone or frozen (its sender thread beats every few "
                         "seconds), and the others wait on it; a rank that still beats while the "
                         "others wait may be doing legitimate rank-only work (a save or an "
                         "evaluation on rank 0) for longer than the window, so it fires as a "
                         "warning"),
        id="rank_stalled",
        severity=Severity.CRITICAL,
        lower_severity=Severity.WARNING,
        lower_when="the stuck rank still sends heartbeats (alive, in its own code or behind: "
        "rank-only work such as a long save can look the same), or its process is stopped "
        "(SIGSTOP)",
        summary="Run {run_id} has a rank that stopped while the others wait for it",
        meaning="one rank stopped making progress (it never began the step the other ranks "
        "are inside, sits in its own code while they wait in a collective, or went silent) "
        "and no rank completed an optimizer step since: the job is hung on that rank",
        fix="look at the named rank: a stuck data loader (lower `dataloader_num_workers`, check "
        "its data shard) or control flow that differs between ranks (a save or evaluation on one)",
        fires_when="on a run of several ranks, no optimizer step for `rank_stalled_seconds` "
        "while a rank lies behind another (it never began the step another rank is inside, "
        "or stopped at an earlier phase of it: forward, backward, gradient sync), sits outside any "
        "collective while the others wait in one, or went silent while the others still "
        "report; the verdict names the rank, its last step, the seconds and where it is",
        thresholds=(Threshold("rank_stalled_seconds", "seconds",
                              "seconds without an optimizer step on any rank, and without "
                              "progress of the stuck rank, before it is named"),),
        evidence=(Evidence("seconds_since_last_step"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None or run.ended:
            return None
        heard = sorted((r for r in run.ranks.values() if r.first_seen), key=lambda r: r.rank)
        if len(heard) < 2:
            return None
        now = run.evaluated_at or time.time()
        limit = settings.rank_stalled_seconds
        newest_step = max(r.last_step_time or r.first_seen for r in heard)
        if now - newest_step <= limit:
            return Verdict(False, step=run.step)
        found = stopped_first(heard, now, limit)
        if found is None or not any(now - r.last_seen <= limit for r in found.waiting):
            return Verdict(False, step=run.step)  # nobody waits: the whole run is stalled
        first = found.first
        seconds = now - since(first)
        mark = first.position
        at = "" if mark.phase == "optimizer_step" else f", at {mark.words()}"
        # Silent while the others report: gone or frozen. Still beating: it may be busy with
        # work only it does (a long save on rank 0), which a healthy job can do too.
        alive = now - first.last_seen <= limit or first.rank in run.suspended_ranks
        return Verdict(
            True,
            step=first.step,
            severity=Severity.WARNING if alive else None,
            summary=(f"rank {first.rank} stopped after step {first.step}{at}, {seconds:.0f} s "
                     f"ago (limit {limit:g} s): {why(found, now)}"),
            evidence={**evidence(found, now),
                      "last_step": fmt(first.step), "began_step": fmt(first.began_step),
                      "seconds": fmt(round(seconds, 1)),
                      "waiting_in_step": fmt(found.furthest.step), "where": first.where or "n/a",
                      "seconds_since_last_message": fmt(round(now - first.last_seen, 1))},
        )


class RankStraggler(SpecDetector):
    """A rank the others consistently wait for: its own work per step takes longest, step
    after step, by a share of the job's step time that matters.

    Each rank times its own part of a step (from the previous optimizer step's end to its last
    forward pass's end: data loading and forward, before the gradient all-reduce where the
    ranks meet) and the whole step. A rank is judged against its peers on the same work and
    against the job: it must be slower than the next rank by the ratio and the margin in most
    steps of the window (a machine slowed for everyone, a CPU hog that preempts one rank now
    and another then, lands on no rank step after step), and what the others wait for it must
    be a material share of the job's step time (a rank a few milliseconds slower in a step of
    seconds costs nothing).
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "ddp-gloo-2-ranks"),
        false_positives=("a rank that does more work by design (rank 0 logging or evaluation; a "
                         "baseline of the job raises the ratio to its healthy runs'): "
                         "information for the job's owner"),
        id="rank_straggler",
        severity=Severity.WARNING,
        summary="Run {run_id} has a rank that every other rank waits for",
        meaning="one rank's own work per step (data loading and forward passes) is "
        "consistently longer than the other ranks', by a material share of the step: every "
        "step waits for it",
        fix="give the slow rank's data loading what the others have (workers, a local copy of "
        "the data) and balance the shards, or move the job off a throttled device",
        fires_when="over the last `straggler_steps` steps every rank timed, one rank's local "
        "seconds are at least `straggler_ratio` times the next rank's and "
        "`straggler_min_seconds` more in 3 of 4 of those steps, and the median difference "
        "is at least `straggler_step_share` of the job's median step time; on a run with a "
        "baseline, the ratio is at least the one its healthy runs' slowest rank showed, "
        "widened by `baseline_margin`",
        policy=Policy.OBSERVE,
        thresholds=(Threshold("straggler_steps", "optimizer steps",
                              "recent steps timed on every rank that the verdict reads"),
                    Threshold("straggler_ratio", "ratio",
                              "the slowest rank's local seconds against the next slowest "
                              "rank's, in a step"),
                    Threshold("straggler_min_seconds", "seconds",
                              "least difference in a step that counts"),
                    Threshold("straggler_step_share", "fraction of a step",
                              "least share of the job's step time the others wait for it")),
        evidence=(Evidence("step"),),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        timed = [r for r in run.ranks.values() if r.local_seconds]
        if len(timed) < 2:
            return None
        per_rank = {r.rank: dict(r.local_seconds) for r in timed}
        common = set.intersection(*(set(times) for times in per_rank.values()))
        window = sorted(common)[-settings.straggler_steps:]
        if len(window) < settings.straggler_steps:
            return Verdict(False)
        medians = {rank: statistics.median(times[s] for s in window)
                   for rank, times in per_rank.items()}
        slowest = max(medians, key=lambda rank: medians[rank])
        others = max(m for rank, m in medians.items() if rank != slowest)
        needed = straggler_ratio(run, settings)  # higher where a baseline's healthy runs were

        def lead(step: int) -> bool:
            mine = per_rank[slowest][step]
            next_one = max(t[step] for rank, t in per_rank.items() if rank != slowest)
            return (mine >= needed * next_one
                    and mine - next_one >= settings.straggler_min_seconds)

        led = sum(1 for s in window if lead(s))
        slow = medians[slowest]
        periods = [seconds for r in timed for step, seconds in r.step_seconds
                   if step in window]
        step_time = statistics.median(periods) if periods else None
        share = (slow - others) / step_time if step_time else None
        if not (4 * led >= 3 * len(window)
                and (share is None or share >= settings.straggler_step_share)):
            return Verdict(False, step=window[-1])
        ratio = slow / others if others > 0 else math.inf
        of_step = (f", {share:.0%} of the job's {step_time:.3g} s step"
                   if share is not None and step_time is not None else "")
        return Verdict(
            True,
            step=window[-1],
            summary=(f"rank {slowest} takes {slow:.3g} s of its own per step against "
                     f"{others:.3g} s on the next rank ({ratio:.3g}x, ahead by the ratio in "
                     f"{led} of {len(window)} steps): every step waits about "
                     f"{slow - others:.3g} s for it{of_step}"),
            evidence={"rank": str(slowest), "local_seconds": fmt(slow),
                      "next_rank_seconds": fmt(others), "ratio": fmt(ratio),
                      "slowest_in_steps": f"{led}/{len(window)}",
                      "step_seconds": fmt(step_time), "share_of_step": fmt(share),
                      "steps": f"{window[0]}-{window[-1]}", "step": fmt(window[-1]),
                      **({} if needed == settings.straggler_ratio
                         else {"baseline_ratio": fmt(needed)})},
        )


class ReplicasDiverged(SpecDetector):
    """Replicated weights that differ between ranks: the ranks train different models.

    Every rank of an unsharded multi-rank run samples the same elements of the same tensors
    at the same steps; the sidecar compares each rank's sample with the lowest rank's. A model
    never wrapped in DDP (each rank trains on its own data), a rank restored from another
    checkpoint, a gradient sync that did not run: each rank's loss looks fine, the model saved
    by rank 0 holds a fraction of the training. Sharded runs are never compared.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin",
                         "ddp-gloo-2-ranks", "replicas-equal-to-rounding"),
        false_positives=("none known at critical: replicas apart by at least one whole "
                         "step's update did not apply the same updates; replicas apart by more "
                         "than the tolerance but less than a step's update can be legitimate "
                         "non-determinism (different kernels per rank, stochastic rounding), "
                         "so that fires as a warning"),
        id="replicas_diverged",
        severity=Severity.CRITICAL,
        lower_severity=Severity.WARNING,
        lower_when="the ranks differ by less than one step's relative update (rounding "
        "between kernels can drift that far; a rank that trains apart soon differs by more)",
        summary="Run {run_id} has ranks whose copies of the same weights disagree",
        meaning="the ranks' copies of the replicated weights differ: each rank trains its own "
        "model (no gradient sync, a rank started from other weights), so the saved model "
        "holds only one rank's share of the training",
        fix="wrap the model (`DistributedDataParallel(model)`, `accelerator.prepare(model)`) "
        "before building the optimizer, and load the same checkpoint on every rank",
        fires_when="an unsharded run of several ranks, at a step every rank sampled: a "
        "sampled tensor whose values on a rank differ from rank 0's by more than "
        "`replica_tolerance` (relative L2); samples at steps 1, 2, 4, ..., 64, then every 64",
        thresholds=(Threshold("replica_tolerance", "relative L2",
                              "largest relative difference between two ranks' samples of a "
                              "tensor that still counts as equal"),),
        evidence=(Evidence("step"),),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        if run.start.sharded:
            return Verdict(False)  # shards differ by design
        sampled = sorted((r for r in run.ranks.values() if r.replicas), key=lambda r: r.rank)
        if len(sampled) < 2:
            return None
        by_rank = {r.rank: {s.step: s for s in r.replicas} for r in sampled}
        common = set.intersection(*(set(steps) for steps in by_rank.values()))
        if not common:
            return None
        step = max(common)
        samples = tuple(by_rank[r.rank][step] for r in sampled)
        tolerance = settings.replica_tolerance
        kept = run.replica_comparison
        if kept is not None and kept[0] == tolerance and len(kept[1]) == len(samples) and all(
                a is b for a, b in zip(kept[1], samples, strict=True)):
            verdict = kept[2]  # the same samples: the same verdict, not compared again
            assert isinstance(verdict, Verdict)
            return verdict
        verdict = self._compare(sampled, samples, step, tolerance,
                                _step_update(sampled[0], step))
        run.replica_comparison = (tolerance, samples, verdict)
        return verdict

    @staticmethod
    def _compare(sampled: list[RankState], samples: tuple[ReplicaSample, ...], step: int,
                 tolerance: float, step_update: float | None) -> Verdict:
        """Every rank's sample against the lowest rank's, at one step."""
        reference = samples[0]
        apart: list[tuple[int, int, float, str]] = []  # rank, tensors apart, largest, a name
        for other, sample in zip(sampled[1:], samples[1:], strict=True):
            if sample.structure != reference.structure or sample.sizes != reference.sizes:
                continue  # other tensors (pipeline stages): not replicas of each other
            differences = _differences(reference, sample)
            over = [(d, name) for d, name in differences if d > tolerance]
            if over:
                largest, name = max(over)
                apart.append((other.rank, len(over), largest, name))
        if not apart:
            return Verdict(False, step=step)
        rank, count, largest, name = apart[0]
        tensors = len(reference.sizes)
        # Apart by a whole step's update or more: the ranks applied different updates.
        # Less: kernels that round differently per rank can drift that far.
        certain = step_update is not None and largest >= step_update
        return Verdict(
            True,
            step=step,
            severity=None if certain else Severity.WARNING,
            summary=(f"at step {step} rank {rank}'s weights differ from rank "
                     f"{sampled[0].rank}'s in {count} of {tensors} sampled tensors (largest "
                     f"relative difference {largest:.3g}, {name}): the ranks train apart"),
            evidence={"rank": str(rank), "ranks_apart": ",".join(str(a[0]) for a in apart),
                      "reference_rank": str(sampled[0].rank), "step": fmt(step),
                      "tensors_apart": f"{count}/{tensors}",
                      "largest_relative_difference": fmt(largest), "tensor": name,
                      "step_relative_update": fmt(step_update)},
        )


def _step_update(rank: RankState, step: int) -> float | None:
    """The rank's relative update (update L2 over the weights' L2) at step, or at the
    nearest step it still holds; None when it measured none."""
    best: tuple[int, float] | None = None
    for point in rank.steps:
        relative = None if point.skipped else point_value(point, "relative_update")
        if relative is None or relative <= 0:
            continue
        distance = abs(point.step - step)
        if best is None or distance < best[0]:
            best = (distance, relative)
    return best[1] if best is not None else None


def _differences(a: ReplicaSample, b: ReplicaSample) -> list[tuple[float, str]]:
    """Per sampled tensor: the relative L2 difference of the two samples, and its name."""
    out: list[tuple[float, str]] = []
    start = 0
    for size, name in zip(a.sizes, a.names, strict=True):
        x, y = a.values[start:start + size], b.values[start:start + size]
        start += size
        diff = math.sqrt(sum((p - q) ** 2 for p, q in zip(x, y, strict=True)))
        scale = max(math.sqrt(sum(p * p for p in x)), math.sqrt(sum(q * q for q in y)))
        if not math.isfinite(diff):
            out.append((math.inf, name))
        elif diff > 0:
            out.append((diff / scale, name))
        else:
            out.append((0.0, name))
    return out
