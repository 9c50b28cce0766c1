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
    """What a verdict says about the run's output, the same for every detector.

    ``critical``: this run's output is certainly wrong or useless, on evidence a healthy run
    cannot produce (pages on-call). ``warning``: the output is likely wrong (a ticket).
    ``info``: worth knowing, nothing is wrong by itself. A detector's spec names the healthy
    recipes it was checked against (``checked_against``) and where it could still misfire
    (``false_positives``): a detector that can misfire on a healthy run is not critical.
    """

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
    #: Fixes for evidence that rules the usual cause out (the first that matches wins).
    fix_cases: tuple[FixCase, ...] = ()
    #: The detectors whose fault can produce this one's verdict on the same run (its direct
    #: causes in the causal graph, ``causes.CausalGraph``): they are listed before it, their
    #: fix is the one shown first, their firing inhibits its page and silencing them quiets it.
    symptom_of: tuple[str, ...] = ()
    #: The healthy recipes this detector ran on and stayed silent, what its severity was
    #: checked against: ``MATRIX`` (every recipe of ``HEALTHY_MATRIX``), ``CONFORMANCE_TWIN``
    #: (its healthy twin in ``tests/unit/test_detector_conformance.py``) and named healthy
    #: controls of the tests (kebab-case, after the test that runs them).
    checked_against: tuple[str, ...] = ()
    #: Where it could still misfire on a healthy run, in a sentence or two (a detector with
    #: none says "none known" and why). A detector with a known misfire is not ``critical``.
    false_positives: str = ""
    #: The lower severity some of its verdicts carry (``Verdict.severity``) and when, for a
    #: detector whose evidence is certain in one case and not in another (a healthy run can
    #: produce the other: it fires lower there), or that steps up as a deviation persists.
    #: ``severity`` is the highest it gives.
    lower_severity: Severity | None = None
    lower_when: str = ""

    @property
    def severity_words(self) -> str:
        """The severity as the generated tables write it: "critical", or "critical (warning
        when ...)" for a detector whose verdicts may carry the lower one."""
        if self.lower_severity is None:
            return self.severity.value
        return f"{self.severity.value} ({self.lower_severity.value} when {self.lower_when})"

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


#: The causes of "nothing learns" most of its symptoms (unchanged checkpoints, a KL stuck at 0,
#: decay-only movement) name in ``symptom_of``.
ROOT_CAUSES = ("frozen_weights", "empty_optimizer")

#: The healthy matrix of ``tests/integration/test_catalogue_healthy.py``: real runs of every
#: TRL trainer on CPU that learn, on which every detector ran and stayed silent (only
#: ``no_kl_anchor``, information, fires for GRPO/RLOO with beta 0). A contract test keeps the
#: names equal to the matrix's.
HEALTHY_MATRIX: tuple[str, ...] = (
    "sft-qwen2-lora-warmup-accum-decay", "sft-llama-adapter", "dpo-qwen2-lora-warmup",
    "dpo-gpt2-adapter-decay", "grpo-qwen2-beta0-lora", "grpo-llama-beta-adapter-accum",
    "grpo-gpt2-beta-lora-warmup-decay", "sft-qwen2-bf16-base-fp32-adapter", "rloo-qwen2-lora",
    "kto-llama-lora", "reward-qwen2-seq-cls", "distillation-qwen2-lora",
)


#: ``checked_against``'s name for the whole healthy matrix, and for a detector's healthy twin
#: in the conformance table.
MATRIX = "healthy-matrix"
CONFORMANCE_TWIN = "conformance-twin"


#: Every detector in the phase a person meets it: what was set up wrong before step 1, then
#: what the steps show, the frozen weights, their symptoms, and last what the run wrote. The
#: order verdicts are listed in is the causal graph's (``symptom_of``: a cause before each of
#: its symptoms, ``causes.CausalGraph.order``); this phase order only breaks its ties, so the
#: order a person reads stays put when an edge is added.
PHASE_ORDER: tuple[str, ...] = (
    # set up wrong at train begin
    "empty_optimizer", "base_weights_trained", "resume_lost_adapter", "inactive_adapter",
    "partial_target_modules", "trainable_out_of_band", "declared_frozen_moved",
    "lora_lr_too_low", "embedding_resized", "unsaved_head", "stop_token_untrained",
    "dataset_shrunk", "adalora_not_allocated", "sharding_fallback", "kl_missing", "no_kl_anchor",
    # what the steps show that stops learning (a reward without spread zeroes the gradient)
    "no_optimizer_step", "replicas_diverged", "nonfinite_loss", "loss_divergence",
    "grad_norm_spike", "rollout_stale", "optimizer_steps_skipped", "zero_reward_variance",
    "zero_gradient", "low_precision_update", "rank_stalled", "stalled", "rank_straggler",
    # the headline verdict, then its symptoms (gradients that no optimizer applies and no
    # zero_grad clears also accumulate: their growth is a symptom there)
    "grad_not_in_optimizer", "frozen_weights", "gradient_accumulating", "negligible_updates",
    "decay_only_update", "kl_stuck_zero", "entropy_collapse",
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


def cause_rank(detector_id: str) -> int:
    """Where a detector's verdict goes in a list (lower first; ``causes.CausalGraph.rank``)."""
    from . import GRAPH  # the graph needs every detector's spec, which imports this module

    return GRAPH.rank(detector_id)


def root_causes_first(detector_ids: Iterable[str]) -> list[str]:
    """The ids once each, every cause before its symptoms (``causes.CausalGraph.causes_first``);
    ids it does not know keep their given order after the known ones."""
    from . import GRAPH

    return GRAPH.causes_first(detector_ids)
