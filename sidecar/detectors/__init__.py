"""Every detector the sidecar runs, in evaluation order.

Add a detector by writing a ``base.SpecDetector`` subclass with its ``spec`` (a
``spec.DetectorSpec``) and ``evaluate`` in a module of this package, listing an instance in
``ALL``, writing its runbook ``alerts/runbooks/<id>.md``, and running ``python -m
alerts.generate``: the rules, their tests, the inhibitions, the PrometheusRule, the runbook
index and the README table follow from the spec.
"""

from __future__ import annotations

from .base import Detector, SpecDetector, Verdict
from .checkpoints import (
    AdapterBloat,
    AdapterNeverTrained,
    CheckpointRefused,
    CheckpointUnchanged,
    EmptyAdapter,
    PickleCheckpoint,
)
from .frozen import FrozenWeights
from .health import DecayOnlyUpdate, NonfiniteLoss, Stalled
from .optimizer import (
    EmptyOptimizer,
    GradNotInOptimizer,
    InactiveAdapter,
)
from .rl import (
    CompletionsTruncated,
    KlMissing,
    KlStuckZero,
    ZeroRewardVariance,
)
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
from .trends import (
    CompletionLengthCollapse,
    DpoLikelihoodCollapse,
    EntropyCollapse,
)

ALL: tuple[Detector, ...] = (
    EmptyOptimizer(),
    GradNotInOptimizer(),
    InactiveAdapter(),
    FrozenWeights(),
    DecayOnlyUpdate(),
    NonfiniteLoss(),
    Stalled(),
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
    CheckpointUnchanged(),
    AdapterNeverTrained(),
    AdapterBloat(),
    EmptyAdapter(),
    PickleCheckpoint(),
    CheckpointRefused(),
)

BY_ID: dict[str, Detector] = {d.id: d for d in ALL}

#: Detectors that judge what a run wrote: they keep their verdict after the run ends.
ARTIFACT_IDS = frozenset(d.id for d in ALL if d.scope == "artifact")

__all__ = ["ALL", "ARTIFACT_IDS", "BY_ID", "Detector", "DetectorSpec", "Policy", "Severity",
           "SpecDetector", "Verdict"]
