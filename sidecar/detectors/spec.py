"""What a detector declares about itself, in one frozen object the class holds as ``spec``.

Everything outside the detector's ``evaluate`` is generated from these: the Prometheus rule and
its promtool cases, the Alertmanager inhibitions, the PrometheusRule, the runbook index, the
README's detector table, and the annotations of the pages the sidecar pushes itself.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
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
class FixCase:
    """A fix that replaces the spec's ``fix`` when the verdict's evidence rules its usual cause
    out (``evidence[key] == value``): the fix shown must follow what the run reported."""

    key: str
    value: str
    fix: str


@dataclass(frozen=True)
class DetectorSpec:
    """Identity, wording, thresholds and evidence of one detector.

    ``summary`` is a one-line page title with a ``{run_id}`` placeholder; ``meaning`` says in
    one sentence what went wrong (alert description, runbook index); ``fix`` says in one
    sentence what to change (the runbook's "How to fix" in short: the trainer's console line and
    the runbook index); ``fires_when`` is the README's Markdown cell; ``cadence`` fills the
    threshold cell when there is no threshold.
    """

    id: str
    severity: Severity
    summary: str
    meaning: str
    fires_when: str
    evidence: tuple[Evidence, ...]
    fix: str
    policy: Policy = Policy.PAGE
    latching: bool = False
    scope: Scope = "run"
    thresholds: tuple[Threshold, ...] = ()
    cadence: str = "at once"
    #: Root-cause detectors whose firing silences this one's page for the same run.
    inhibited_by: tuple[str, ...] = ()
    #: Fixes for evidence that rules the usual cause out (the first that matches wins).
    fix_cases: tuple[FixCase, ...] = ()

    @property
    def runbook(self) -> str:
        """The runbook's file name under ``alerts/runbooks/`` (and the sidecar's /runbooks/)."""
        return f"{self.id}.md"

    def fix_for(self, evidence: Mapping[str, str] | None = None) -> str:
        """The fix the evidence supports: a matching ``fix_cases`` entry, else ``fix``."""
        for case in self.fix_cases:
            if evidence is not None and evidence.get(case.key) == case.value:
                return case.fix
        return self.fix

    def render_summary(self, run_id: str) -> str:
        return self.summary.format(run_id=run_id)

    def render_description(self, run_id: str, evidence: str) -> str:
        """The description both alert paths send: the run, what it means, the evidence."""
        return f"Run {run_id}: {self.meaning}. Evidence: {evidence}."


#: Root causes of "nothing learns": while one fires for a run, its symptoms (zero reward
#: spread, unchanged checkpoints, ...) would only page twice for the same fault.
ROOT_CAUSES = ("frozen_weights", "empty_optimizer")


#: Every detector in the order a person should read its verdicts: a cause before the symptoms
#: it produces (what was set up wrong before step 1, then what the steps show, the frozen
#: weights, their symptoms, and last what the run wrote). Consistent with ``inhibited_by``: a
#: root cause comes before every detector it inhibits, with one exception: gradients that no
#: optimizer applies are why weights stay frozen (the optimizer got the wrong parameters, or
#: ``requires_grad`` came back after it was built), so ``grad_not_in_optimizer`` reads before
#: ``frozen_weights`` though its page waits for it. Console, status, report, summary and
#: inspect all list verdicts through ``root_causes_first``.
CAUSES_FIRST: tuple[str, ...] = (
    # set up wrong at train begin
    "empty_optimizer", "base_weights_trained", "resume_lost_adapter", "inactive_adapter",
    "partial_target_modules", "trainable_out_of_band", "declared_frozen_moved",
    "lora_lr_too_low", "embedding_resized", "unsaved_head", "stop_token_untrained",
    "dataset_shrunk", "adalora_not_allocated", "sharding_fallback", "kl_missing", "no_kl_anchor",
    # what the steps show that stops learning
    "no_optimizer_step", "replicas_diverged", "nonfinite_loss", "loss_divergence",
    "grad_norm_spike", "rollout_stale", "optimizer_steps_skipped", "zero_gradient",
    "low_precision_update", "rank_stalled", "stalled", "rank_straggler",
    # the headline verdict, then its symptoms (gradients that no optimizer applies and no
    # zero_grad clears also accumulate: their growth is a symptom there)
    "grad_not_in_optimizer", "frozen_weights", "gradient_accumulating", "negligible_updates",
    "zero_reward_variance", "decay_only_update", "kl_stuck_zero", "entropy_collapse",
    "completion_length_collapse", "completions_truncated", "dpo_likelihood_collapse",
    # what the run wrote
    "checkpoint_unchanged", "adapter_never_trained", "empty_adapter", "adapter_bloat",
    "pickle_checkpoint", "checkpoint_refused",
    # how the run is reported (two jobs on one id, steps that go back)
    "run_id_in_use", "step_out_of_order",
    # unlike the known-good run it names: what trains, then the trajectories (a cause first)
    "baseline_recipe_changed", "baseline_modules_changed", "baseline_learning_rate",
    "baseline_grad_norm", "baseline_update_size", "baseline_loss", "baseline_rl_signals",
)
_CAUSE_RANK = {detector: rank for rank, detector in enumerate(CAUSES_FIRST)}


def cause_rank(detector_id: str) -> int:
    """Where a detector's verdict goes in a list (lower first); unknown ids go last."""
    return _CAUSE_RANK.get(detector_id, len(_CAUSE_RANK))


def root_causes_first(detector_ids: Iterable[str]) -> list[str]:
    """The ids once each, root causes before their symptoms (``CAUSES_FIRST``); ids it does
    not know keep their given order after the known ones."""
    return sorted(dict.fromkeys(detector_ids), key=cause_rank)
