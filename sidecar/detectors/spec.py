"""What a detector declares about itself, in one frozen object the class holds as ``spec``.

Everything outside the detector's ``evaluate`` is generated from these: the Prometheus rule and
its promtool cases, the Alertmanager inhibitions, the PrometheusRule, the runbook index, the
README's detector table, and the annotations of the pages the sidecar pushes itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal


class Severity(str, enum.Enum):
    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"


class Policy(str, enum.Enum):
    """What firing leads to; each level includes the ones before it."""

    OBSERVE = "observe"
    PAGE = "page"
    STOP = "stop"
    KILL = "kill"


#: "run": the verdict is about the training itself, judged while the run is live;
#: "artifact": it is about what the run wrote, judged also after the run ended. Either way a
#: verdict still firing when the run ends stands (firing at end) until the run expires.
Scope = Literal["run", "artifact"]


@dataclass(frozen=True)
class Threshold:
    """One tunable a detector reads: a ``DetectorSettings`` field, its unit and its meaning.

    The default stays on the typed ``DetectorSettings`` field (so mypy checks every read and
    ``--setting NAME=VALUE`` keeps its names); who owns it and what it means live here.
    """

    name: str
    unit: str
    doc: str


@dataclass(frozen=True)
class Evidence:
    """A metric the alert's description quotes, by its name without ``deadweight_``.

    ``firing`` is its value in the promtool case where the alert fires (None: the healthy
    value of that metric, i.e. the metric is quoted but does not show the failure).
    """

    metric: str
    firing: float | None = None


@dataclass(frozen=True)
class DetectorSpec:
    """Identity, wording, thresholds and evidence of one detector.

    ``summary`` is a one-line page title with a ``{run_id}`` placeholder; ``meaning`` says in
    one sentence what went wrong (alert description, runbook index); ``fires_when`` is the
    README's Markdown cell; ``cadence`` fills the threshold cell when there is no threshold.
    """

    id: str
    severity: Severity
    summary: str
    meaning: str
    fires_when: str
    evidence: tuple[Evidence, ...]
    policy: Policy = Policy.PAGE
    latching: bool = False
    scope: Scope = "run"
    thresholds: tuple[Threshold, ...] = ()
    cadence: str = "at once"
    #: Root-cause detectors whose firing silences this one's page for the same run.
    inhibited_by: tuple[str, ...] = ()

    @property
    def runbook(self) -> str:
        """The runbook's file name under ``alerts/runbooks/`` (and the sidecar's /runbooks/)."""
        return f"{self.id}.md"

    def render_summary(self, run_id: str) -> str:
        return self.summary.format(run_id=run_id)

    def render_description(self, run_id: str, evidence: str) -> str:
        """The description both alert paths send: the run, what it means, the evidence."""
        return f"Run {run_id}: {self.meaning}. Evidence: {evidence}."


#: Root causes of "nothing learns": while one fires for a run, its symptoms (zero reward
#: spread, unchanged checkpoints, ...) would only page twice for the same fault.
ROOT_CAUSES = ("frozen_weights", "empty_optimizer")

#: cause -> the verdicts it brings about (a reader fixes the cause, not its symptoms). An
#: optimizer built empty freezes the weights; frozen weights leave every checkpoint the same
#: as the initial adapter and every group's reward spread at zero.
SYMPTOMS: dict[str, tuple[str, ...]] = {
    "empty_optimizer": ("frozen_weights", "grad_not_in_optimizer", "zero_gradient",
                        "checkpoint_unchanged", "adapter_never_trained"),
    "frozen_weights": ("checkpoint_unchanged", "adapter_never_trained", "decay_only_update",
                       "grad_not_in_optimizer", "kl_stuck_zero", "zero_reward_variance"),
}


def _causes(detector: str) -> set[str]:
    """Every detector that brings detector about, directly or through another."""
    found: set[str] = set()
    todo = [detector]
    while todo:
        symptom = todo.pop()
        for cause, symptoms in SYMPTOMS.items():
            if symptom in symptoms and cause not in found:
                found.add(cause)
                todo.append(cause)
    return found


def root_causes_first(detector_ids: list[str]) -> list[str]:
    """detector_ids with each cause before its symptoms; otherwise in the order given."""
    pending = list(detector_ids)
    ordered: list[str] = []
    while pending:
        present = set(pending)
        index = next((i for i, d in enumerate(pending) if not _causes(d) & present - {d}), 0)
        ordered.append(pending.pop(index))
    return ordered
