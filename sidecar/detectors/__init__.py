"""Every detector the sidecar runs, in evaluation order.

Add a detector by writing a ``base.SpecDetector`` subclass with its ``spec`` (a
``spec.DetectorSpec``) and ``evaluate`` in a module of this package, listing an instance in
``ALL``, writing its runbook ``alerts/runbooks/<id>.md``, and running ``python -m
alerts.generate``: the rules, their tests, the inhibitions, the PrometheusRule, the runbook
index and the README table follow from the spec.
"""

from __future__ import annotations

from deadweight.sidecar.detectors.base import Detector, SpecDetector, Verdict
from deadweight.sidecar.detectors.checkpoints import (
    AdapterBloat,
    AdapterNeverTrained,
    CheckpointRefused,
    CheckpointUnchanged,
    EmptyAdapter,
    PickleCheckpoint,
)
from deadweight.sidecar.detectors.divergence import GradNormSpike, LossDivergence
from deadweight.sidecar.detectors.frozen import FrozenWeights
from deadweight.sidecar.detectors.health import DecayOnlyUpdate, NonfiniteLoss, Stalled
from deadweight.sidecar.detectors.loop import (
    DeclaredFrozenMoved,
    GradientAccumulating,
    NoOptimizerStep,
)
from deadweight.sidecar.detectors.negligible import NegligibleUpdates
from deadweight.sidecar.detectors.optimizer import (
    EmptyOptimizer,
    GradNotInOptimizer,
    InactiveAdapter,
)
from deadweight.sidecar.detectors.reporting import RunIdInUse, StepOutOfOrder
from deadweight.sidecar.detectors.ranks import RankStalled, RankStraggler, ReplicasDiverged
from deadweight.sidecar.detectors.rl import (
    CompletionsTruncated,
    KlMissing,
    KlStuckZero,
    ZeroRewardVariance,
)
from deadweight.sidecar.detectors.rollout import RolloutStale
from deadweight.sidecar.detectors.setup import (
    EmbeddingResized,
    LoraLrTooLow,
    NoKlAnchor,
    PartialTargetModules,
    ShardingFallback,
)
from deadweight.sidecar.detectors.spec import DetectorSpec, Policy, Severity
from deadweight.sidecar.detectors.start_facts import (
    AdaloraNotAllocated,
    DatasetShrunk,
    ResumeLostAdapter,
    StopTokenUntrained,
    UnsavedHead,
)
from deadweight.sidecar.detectors.step_figures import (
    LowPrecisionUpdate,
    OptimizerStepsSkipped,
    ZeroGradient,
)
from deadweight.sidecar.detectors.trainable import BaseWeightsTrained, TrainableOutOfBand
from deadweight.sidecar.detectors.trends import (
    CompletionLengthCollapse,
    DpoLikelihoodCollapse,
    EntropyCollapse,
)

ALL: tuple[Detector, ...] = (
    EmptyOptimizer(),
    BaseWeightsTrained(),
    TrainableOutOfBand(),
    GradNotInOptimizer(),
    InactiveAdapter(),
    NoOptimizerStep(),
    FrozenWeights(),
    NegligibleUpdates(),
    DecayOnlyUpdate(),
    NonfiniteLoss(),
    LossDivergence(),
    GradNormSpike(),
    GradientAccumulating(),
    DeclaredFrozenMoved(),
    Stalled(),
    RankStalled(),
    RankStraggler(),
    ReplicasDiverged(),
    PartialTargetModules(),
    EmbeddingResized(),
    LoraLrTooLow(),
    NoKlAnchor(),
    ShardingFallback(),
    KlMissing(),
    KlStuckZero(),
    ZeroRewardVariance(),
    EntropyCollapse(),
    CompletionLengthCollapse(),
    DpoLikelihoodCollapse(),
    ZeroGradient(),
    OptimizerStepsSkipped(),
    LowPrecisionUpdate(),
    StopTokenUntrained(),
    UnsavedHead(),
    DatasetShrunk(),
    ResumeLostAdapter(),
    AdaloraNotAllocated(),
    CompletionsTruncated(),
    RolloutStale(),
    CheckpointUnchanged(),
    AdapterNeverTrained(),
    AdapterBloat(),
    EmptyAdapter(),
    PickleCheckpoint(),
    CheckpointRefused(),
    StepOutOfOrder(),
    RunIdInUse(),
)

BY_ID: dict[str, Detector] = {d.id: d for d in ALL}

#: Detectors that judge what a run wrote: they keep their verdict after the run ends.
ARTIFACT_IDS = frozenset(d.id for d in ALL if d.scope == "artifact")

__all__ = ["ALL", "ARTIFACT_IDS", "BY_ID", "Detector", "DetectorSpec", "Policy", "Severity",
           "SpecDetector", "Verdict"]
