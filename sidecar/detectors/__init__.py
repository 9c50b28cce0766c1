"""Every detector the sidecar runs, in evaluation order.

Add a detector by writing a ``base.SpecDetector`` subclass with its ``spec`` (a
``spec.DetectorSpec``) and ``evaluate`` in a module of this package, listing an instance in
``ALL``, writing its runbook ``alerts/runbooks/<id>.md``, and running ``python -m
alerts.generate``: the rules, their tests, the inhibitions, the PrometheusRule, the runbook
index and the README table follow from the spec.
"""

from __future__ import annotations

from collections.abc import Mapping

from .base import Detector, SpecDetector, Verdict
from .baseline import (
    BaselineGradNorm,
    BaselineLearningRate,
    BaselineLoss,
    BaselineModulesChanged,
    BaselineRecipeChanged,
    BaselineRlSignals,
    BaselineUpdateSize,
)
from .causes import CausalGraph
from .checkpoints import (
    AdapterBloat,
    AdapterNeverTrained,
    CheckpointRefused,
    CheckpointUnchanged,
    EmptyAdapter,
    PickleCheckpoint,
)
from .divergence import GradNormSpike, LossDivergence
from .frozen import FrozenWeights
from .health import DecayOnlyUpdate, NonfiniteLoss, Stalled
from .loop import (
    DeclaredFrozenMoved,
    GradientAccumulating,
    NoOptimizerStep,
)
from .negligible import NegligibleUpdates
from .optimizer import (
    EmptyOptimizer,
    GradNotInOptimizer,
    InactiveAdapter,
)
from .ranks import RankStalled, RankStraggler, ReplicasDiverged
from .reporting import RunIdInUse, StepOutOfOrder
from .rl import (
    CompletionsTruncated,
    KlMissing,
    KlStuckZero,
    ZeroRewardVariance,
)
from .rollout import RolloutStale
from .setup import (
    EmbeddingResized,
    LoraLrTooLow,
    NoKlAnchor,
    PartialTargetModules,
    ShardingFallback,
)
from .spec import DetectorSpec, Policy, Severity
from .start_facts import (
    AdaloraNotAllocated,
    DatasetShrunk,
    ResumeLostAdapter,
    StopTokenUntrained,
    UnsavedHead,
)
from .step_figures import (
    LowPrecisionUpdate,
    OptimizerStepsSkipped,
    ZeroGradient,
)
from .trainable import BaseWeightsTrained, TrainableOutOfBand
from .trends import (
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
    BaselineRecipeChanged(),
    BaselineModulesChanged(),
    BaselineLearningRate(),
    BaselineGradNorm(),
    BaselineUpdateSize(),
    BaselineLoss(),
    BaselineRlSignals(),
)

BY_ID: dict[str, Detector] = {d.id: d for d in ALL}

#: Which verdict can be a symptom of which (the specs' ``symptom_of``): the order of every
#: list of verdicts, the inhibitions and the reach of a silence.
GRAPH = CausalGraph(d.spec for d in ALL)

#: Detectors that judge what a run wrote: they keep their verdict after the run ends.
ARTIFACT_IDS = frozenset(d.id for d in ALL if d.scope == "artifact")

__all__ = [
    "ALL",
    "ARTIFACT_IDS",
    "BY_ID",
    "GRAPH",
    "Detector",
    "DetectorSpec",
    "Policy",
    "Severity",
    "SpecDetector",
    "Verdict",
    "fix_sentence",
    "root_causes_of",
]


def root_causes_of(detector: str) -> tuple[str, ...]:
    """The causes whose firing inhibits this detector's page for the same run, and whose
    silence quiets it while they fire (``GRAPH.inhibitors_of``; () for a root cause, or an id
    that is no detector)."""
    return GRAPH.inhibitors_of(detector)


def fix_sentence(detector: str, evidence: Mapping[str, str] | None = None) -> str:
    """The fix of one detector as a sentence: its spec's ``fix`` (or the ``fix_cases`` entry
    the verdict's evidence selects), the one source of the fix wording wherever a verdict is
    told (console, report, pages, webhooks, runbook index), capitalised and closed. '' for an
    id that is no detector."""
    found = BY_ID.get(detector)
    if found is None:
        return ""
    fix = found.spec.fix_for(evidence).strip()
    fix = fix[:1].upper() + fix[1:]
    return fix if fix.endswith(".") else fix + "."
