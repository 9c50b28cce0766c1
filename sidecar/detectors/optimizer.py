"""Detectors over optimizer membership: parameters that should train but never can."""

from __future__ import annotations

from ...proto import pb
from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from ..model.step_point import StepPoint
from .base import (
    ADAPTER_MADE_TRAINABLE,
    FROZEN_AFTER_LOAD_FIX,
    SpecDetector,
    Verdict,
    adapter_made_trainable,
    fmt,
    start_facts_or_silent,
)
from .spec import (
    DetectorSpec,
    Evidence,
    FixCase,
    Severity,
    Threshold,
)

#: The fix shown when the run reported the adapter was made trainable.
_FROZEN_AFTER_LOAD = (FixCase(ADAPTER_MADE_TRAINABLE, "true", FROZEN_AFTER_LOAD_FIX),)

#: ``OptimizerMembership.layout`` when the client could not map the optimizer's partitions.
MEMBERSHIP_UNKNOWN = "unknown"


class EmptyOptimizer(SpecDetector):
    """At train begin the optimizer holds no parameters: nothing this run does can train.

    The classic cause is ``PeftModel.from_pretrained(base, path)`` without
    ``is_trainable=True``: every adapter tensor is frozen when the optimizer is built.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin",
                         "deepspeed-zero-loop", "optimizer-family-loops"),
        false_positives=("none known on a trainer: a healthy run's optimizer always holds a "
                         "parameter; an optimizer the probe cannot map (some DeepSpeed wrappers) "
                         "is reported unknown, not empty"),
        id="empty_optimizer",
        severity=Severity.CRITICAL,
        latching=True,
        summary="Run {run_id} trains with an optimizer that holds no parameters",
        meaning="the optimizer was built with zero parameters, so no step can change the model",
        fix="load the adapter with `PeftModel.from_pretrained(base, path, is_trainable=True)` (or "
        "pass `peft_config=` to the trainer) and restart the run",
        fires_when="at train begin the optimizer holds 0 parameters (e.g. "
        "`PeftModel.from_pretrained` without `is_trainable=True`)",
        evidence=(Evidence("optimizer_params", 0), Evidence("trainable_params", 0),
                  Evidence("grad_norm"), Evidence("loss")),
        fix_cases=_FROZEN_AFTER_LOAD,
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        start = start_facts_or_silent(run)
        if not isinstance(start, pb.RunStart):
            return start
        m = start.membership
        if m.optimizer_tensors > 0 or m.layout == MEMBERSHIP_UNKNOWN:
            return Verdict(False)  # unknown: a partitioning optimizer the client cannot map
        return Verdict(
            True,
            step=0,
            summary=(
                f"optimizer holds 0 parameters at train begin; {m.adapter_params} adapter "
                f"params and {m.trainable_params} trainable params exist"
            ),
            evidence={
                "optimizer_tensors": fmt(m.optimizer_tensors),
                "optimizer_params": fmt(m.optimizer_params),
                "trainable_params": fmt(m.trainable_params),
                "adapter_params": fmt(m.adapter_params),
                "adapter_tensors": fmt(m.adapter_tensors),
                ADAPTER_MADE_TRAINABLE: adapter_made_trainable(run),
                "step": "0 (train begin)",
            },
        )


class GradNotInOptimizer(SpecDetector):
    """Parameters get gradients that no optimizer applies: grad_norm looks alive, nothing learns.

    At train begin: tensors with ``requires_grad`` that the optimizer does not hold. Per step:
    tensors outside the optimizer that carry a ``.grad`` at the optimizer step. The second is
    how an adapter loaded without ``is_trainable=True`` looks under GRPO with beta > 0: the
    reference pass re-enables ``requires_grad`` after the optimizer was built empty.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("parameters left with requires_grad on purpose but trained by a second "
                         "optimizer the probe does not see: a warning (an empty optimizer, "
                         "the case that is certain, is `empty_optimizer`'s critical)"),
        symptom_of=("empty_optimizer", "inactive_adapter"),
        id="grad_not_in_optimizer",
        severity=Severity.WARNING,
        summary="Run {run_id} computes gradients for parameters its optimizer does not hold",
        meaning="parameters receive gradients (grad_norm looks alive) but are not in the "
        "optimizer, so they are never updated",
        fix="load the adapter with `is_trainable=True` and set every adapter and `requires_grad` "
        "before the trainer builds its optimizer",
        fires_when="parameters require grad at train begin but are not in the optimizer, or "
        "carry a `.grad` at an optimizer step while the optimizer lacks them (F1 under GRPO "
        "with beta > 0: the reference pass re-enables `requires_grad`)",
        cadence="at once, per step",
        evidence=(Evidence("grad_not_in_optimizer_params", 8), Evidence("optimizer_params", 0),
                  Evidence("grad_norm"), Evidence("update_norm", 0)),
        fix_cases=_FROZEN_AFTER_LOAD,
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        start = start_facts_or_silent(run)
        if not isinstance(start, pb.RunStart):
            return start
        m = start.membership
        steps = run.combined_steps()
        latest = steps[-1] if steps else None
        if latest is not None and latest.grad_not_in_optimizer_tensors > 0:
            first = latest
            for point in reversed(steps):
                if point.grad_not_in_optimizer_tensors == 0:
                    break
                first = point
            return Verdict(
                True,
                step=first.step,
                summary=(
                    f"{latest.grad_not_in_optimizer_params} params in "
                    f"{latest.grad_not_in_optimizer_tensors} tensors received gradients at step "
                    f"{latest.step} but the optimizer ({latest.optimizer_params} params) does "
                    f"not hold them"
                ),
                evidence={
                    "grad_not_in_optimizer_tensors": fmt(latest.grad_not_in_optimizer_tensors),
                    "grad_not_in_optimizer_params": fmt(latest.grad_not_in_optimizer_params),
                    "optimizer_params": fmt(latest.optimizer_params),
                    "first_step": fmt(first.step),
                    "step": fmt(latest.step),
                    "update_norm": fmt(latest.update_norm),
                    "grad_norm": fmt(run.log_value("grad_norm")),
                    ADAPTER_MADE_TRAINABLE: adapter_made_trainable(run),
                },
            )
        if m.trainable_not_in_optimizer_tensors > 0:
            return Verdict(
                True,
                step=0,
                summary=(
                    f"{m.trainable_not_in_optimizer_tensors} tensors require grad at train "
                    f"begin but are not in the optimizer"
                ),
                evidence={
                    "trainable_not_in_optimizer_tensors": fmt(
                        m.trainable_not_in_optimizer_tensors),
                    "trainable_tensors": fmt(m.trainable_tensors),
                    "optimizer_tensors": fmt(m.optimizer_tensors),
                    ADAPTER_MADE_TRAINABLE: adapter_made_trainable(run),
                    "step": "0 (train begin)",
                },
            )
        return Verdict(False, step=latest.step if latest else 0)


#: The name TRL gives the frozen reference copy it adds when a saved adapter is re-trained
#: against a reference (DPO, KTO, GRPO and RLOO alike): ``add_adapter("ref", <the trained
#: adapter's config>)``, its tensors copied from the trained adapter, kept out of the optimizer.
REFERENCE_ADAPTER = "ref"


def _is_reference_copy(share: pb.AdapterCoverage, trained: list[pb.AdapterCoverage]) -> bool:
    """A frozen reference copy of an adapter that trains: named so and shaped like it.

    Judged by what the trainer did (a copy of the trained adapter under the reference name),
    not by which trainer it was, so every trainer that keeps such a copy is covered."""
    return share.name == REFERENCE_ADAPTER and any(
        (t.tensors, t.params) == (share.tensors, share.params) for t in trained)


def _finished_before(idle: pb.AdapterCoverage, adapters: list[pb.AdapterCoverage],
                     trained: list[pb.AdapterCoverage]) -> bool:
    """Whether idle was added before every adapter that trains: an earlier adapter kept frozen
    while a newer one trains (adapters trained one after another: ``add_adapter`` then
    ``set_adapter``). An adapter added after the one that trains is the one meant to train
    next, never activated. ``adapters`` is in the order the model added them."""
    order = {a.name: i for i, a in enumerate(adapters)}
    return all(order[idle.name] < order[t.name] for t in trained)


class InactiveAdapter(SpecDetector):
    """An adapter the run holds is not the one that trains.

    Either a second adapter was added but never activated (at train begin: it has tensors, the
    optimizer holds none of them, while an adapter added before it is in the optimizer), or
    ``set_adapter`` switched adapters mid-run (an adapter the optimizer holds stays unchanged
    for K steps while gradients go to tensors outside the optimizer or another adapter moves).
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "grpo-dpo-ref-adapter"),
        false_positives=("none known at critical: an adapter the optimizer holds that stands "
                         "still while gradients go elsewhere, or an active adapter none of "
                         "whose tensors the optimizer holds, never trains. An inactive adapter "
                         "kept out of the optimizer can be one loaded on purpose for inference "
                         "or comparison and never meant to train: a warning (TRL's own `ref` "
                         "copy, and an earlier adapter kept while a newer one trains, are "
                         "exempt)"),
        id="inactive_adapter",
        severity=Severity.CRITICAL,
        lower_severity=Severity.WARNING,
        lower_when="the idle adapter is not the active one (at train begin: an adapter loaded "
        "on purpose for inference or comparison looks the same)",
        summary="Run {run_id} trains an adapter other than the one it saves",
        meaning="an adapter the run was configured to train is not active or not in the "
        "optimizer (never activated, or switched by set_adapter mid-run)",
        fix="activate the adapter to train (`model.set_adapter(name)`, loaded with "
        "`is_trainable=True`) before building the trainer, and never switch it during training",
        fires_when="an adapter added after the one that trains (or still active) has tensors "
        "but none in the optimizer; or an adapter the optimizer holds stays unchanged while "
        "gradients go elsewhere (`set_adapter` mid-run). An earlier adapter left frozen while a "
        "newer one trains (adapters trained one after another) and TRL's frozen `ref` copy of "
        "the trained adapter are exempt",
        thresholds=(Threshold("inactive_adapter_steps", "optimizer steps",
                              "consecutive optimizer steps (lr > 0) in which an adapter the "
                              "optimizer holds stayed unchanged while another adapter received "
                              "gradients or moved"),),
        evidence=(Evidence("optimizer_params", 4), Evidence("trainable_params"),
                  Evidence("grad_not_in_optimizer_params", 4)),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        start = start_facts_or_silent(run)
        if not isinstance(start, pb.RunStart):
            return start
        adapters = list(start.membership.adapters)
        training = [a for a in adapters if a.in_optimizer_tensors > 0]
        trained = {a.name for a in training}
        idle = [a for a in adapters if a.tensors > 0 and a.in_optimizer_tensors == 0
                and not _is_reference_copy(a, training)
                and not (not a.active and _finished_before(a, adapters, training))]
        switched = self._switched(run, settings, trained)
        if switched is not None and switched.firing:
            return switched  # the current, more specific verdict
        if trained and idle:
            # An active adapter the optimizer lacks never trains; an inactive one may be
            # loaded on purpose (for inference, to compare against).
            certain = any(a.active for a in idle)
            return Verdict(
                True,
                step=0,
                severity=None if certain else Severity.WARNING,
                summary=(
                    f"adapter(s) {', '.join(a.name for a in idle)} have "
                    f"{sum(a.params for a in idle)} params and none in the optimizer; only "
                    f"{', '.join(sorted(trained))} trains"
                ),
                evidence={
                    "idle_adapters": ",".join(a.name for a in idle),
                    "idle_adapter_params": fmt(sum(a.params for a in idle)),
                    "trained_adapters": ",".join(sorted(trained)),
                    "active_adapter": start.preflight.active_adapter,
                    "step": "0 (train begin)",
                },
            )
        return switched

    def _switched(self, run: RunState, settings: DetectorSettings, trained: set[str]
                  ) -> Verdict | None:
        if not trained:
            return None
        window: list[StepPoint] = []  # the newest steps that moved adapters, newest first
        for point in reversed(run.combined_steps()):  # groups are decoded for these only
            if point.learning_rate > 0 and point.adapter_updates:
                window.append(point)
                if len(window) == settings.inactive_adapter_steps:
                    break
        if not window:
            return None
        window.reverse()
        if len(window) < settings.inactive_adapter_steps:
            return Verdict(False, step=window[-1].step)
        present = {g[0] for g in window[-1].adapter_updates}  # a stuck adapter is reported
        # Per step, once: which adapters stood still and which moved (a heartbeat re-runs
        # this; a set lookup per adapter keeps it linear in the 64 adapters a step keeps).
        still = [{g[0] for g in p.adapter_updates if g[1] == 0 and g[2] == g[3]}
                 for p in window]
        moved = [(p.grad_not_in_optimizer_tensors > 0, {g[0] for g in p.adapter_updates
                                                         if g[1] > 0}) for p in window]
        for name in sorted(trained & present):  # in every step: only these can be stuck
            stuck = all(name in names for names in still)
            elsewhere = all(outside or len(names - {name}) > 0 for outside, names in moved)
            if stuck and elsewhere:
                last = window[-1]
                return Verdict(
                    True,
                    step=window[0].step,
                    summary=(
                        f"adapter {name} is in the optimizer but unchanged for "
                        f"{len(window)} steps while gradients go elsewhere "
                        f"({last.grad_not_in_optimizer_tensors} tensors outside the optimizer)"
                    ),
                    evidence={
                        "stuck_adapter": name,
                        "steps": f"{window[0].step}-{last.step}",
                        "grad_not_in_optimizer_tensors": fmt(last.grad_not_in_optimizer_tensors),
                        "active_adapter_at_start": run.start.preflight.active_adapter
                        if run.start else "",
                        "update_norm": fmt(last.update_norm),
                    },
                )
        return Verdict(False, step=window[-1].step)
