"""What a detector declares about itself, in one frozen object the class holds as ``spec``.

Everything outside the detector's ``evaluate`` is generated from these: the Prometheus rule and
its promtool cases, the Alertmanager inhibitions, the PrometheusRule, the runbook index, the
README's detector table, and the annotations of the pages the sidecar pushes itself.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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


#: "run": the verdict is about the training itself and resolves when the run ends;
#: "artifact": it is about what the run wrote and stands until the finished run expires.
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

#: cause -> the verdicts it brings about in the same run. Wherever verdicts are listed, a
#: cause comes before its symptoms (``root_causes_first``), so a reader meets the fault first
#: and its consequences after. Kept acyclic (a test checks it); ids absent here keep their
#: place among themselves.
CAUSE_SYMPTOMS: dict[str, tuple[str, ...]] = {
    "empty_optimizer": ("grad_not_in_optimizer", "frozen_weights", "zero_gradient",
                        "decay_only_update", "kl_stuck_zero", "checkpoint_unchanged",
                        "adapter_never_trained"),
    "inactive_adapter": ("grad_not_in_optimizer", "frozen_weights", "checkpoint_unchanged",
                         "adapter_never_trained"),
    "lora_lr_too_low": ("frozen_weights", "checkpoint_unchanged", "adapter_never_trained"),
    "zero_reward_variance": ("zero_gradient", "decay_only_update", "frozen_weights",
                             "kl_stuck_zero", "checkpoint_unchanged", "adapter_never_trained"),
    "zero_gradient": ("decay_only_update", "checkpoint_unchanged", "adapter_never_trained"),
    "grad_not_in_optimizer": ("frozen_weights", "kl_stuck_zero", "checkpoint_unchanged",
                              "adapter_never_trained"),
    "frozen_weights": ("kl_stuck_zero", "checkpoint_unchanged", "adapter_never_trained"),
    "no_kl_anchor": ("entropy_collapse", "completion_length_collapse"),
    "embedding_resized": ("adapter_bloat",),
    "stop_token_untrained": ("completions_truncated",),
}


def _causes_of() -> dict[str, frozenset[str]]:
    """symptom -> every cause upstream of it (the table's transitive closure)."""
    upstream: dict[str, set[str]] = {}
    for cause, symptoms in CAUSE_SYMPTOMS.items():
        for symptom in symptoms:
            upstream.setdefault(symptom, set()).add(cause)
    changed = True
    while changed:
        changed = False
        for causes in upstream.values():
            wider = set().union(*(upstream.get(c, set()) for c in causes)) - causes
            if wider:
                causes |= wider
                changed = True
    return {symptom: frozenset(causes) for symptom, causes in upstream.items()}


_UPSTREAM = _causes_of()


def root_causes_first(detector_ids: Sequence[str]) -> list[str]:
    """The ids reordered so that every cause precedes its symptoms (``CAUSE_SYMPTOMS``);
    otherwise the given order is kept, and each id appears once."""
    remaining = list(dict.fromkeys(detector_ids))
    ordered: list[str] = []
    while remaining:
        left = set(remaining)
        pick = next((d for d in remaining if not _UPSTREAM.get(d, frozenset()) & left),
                    remaining[0])  # a cycle cannot happen with an acyclic table
        ordered.append(pick)
        remaining.remove(pick)
    return ordered
