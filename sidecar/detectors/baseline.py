"""``baseline_*``: a run compared with a known-good run of the same recipe.

Silent unless the run named a baseline (``baseline=``, ``DEADWEIGHT_BASELINE``). Each detector
names the quantity, the module kind where there is one, the step, the run's value and the
baseline's band. A trajectory fires only after ``baseline_steps`` consecutive points outside
the band widened by ``baseline_margin`` (a single noisy step never does), first as info, and
steps up to warning once the deviation has lasted ``baseline_escalate_steps`` points: a
healthy run on other data can leave a band for a while, a broken recipe stays out. Never
critical, for the same reason. Its evidence keeps growing while the deviation lasts. A recipe
whose fingerprint differs is still compared on what is comparable; one info verdict says
what differs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..baseline import fingerprint as prints
from ..baseline.live import Deviation, baseline_of, deviation, parsed, total_steps
from ..baseline.model import Baseline, BaselineError
from ..baseline.quantities import MARGIN_SCALE, RL_QUANTITIES, point_value, update_over_lr
from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from ..model.step_point import MAX_MODULE_KINDS_PER_STEP, StepPoint, module_label
from .base import SpecDetector, Verdict, fmt, trailing_streak
from .spec import DetectorSpec, Evidence, Policy, Severity, Threshold

STEPS = Threshold("baseline_steps", "points", "consecutive steps (or log reports) outside the "
                  "baseline's band before a trajectory verdict fires")
MARGIN = Threshold("baseline_margin", "fraction", "how far outside its band a value may lie: "
                   "the band's width or this fraction of its size, whichever is larger")
ESCALATE = Threshold("baseline_escalate_steps", "points", "consecutive points outside the "
                     "band (counted as for `baseline_steps`) before an info verdict steps up "
                     "to warning (at most 64, the longest streak a walk counts)")
#: The lower severity of a trajectory verdict, and when (the specs' ``lower_when``).
LOWER_WHEN = ("the deviation has lasted fewer than `baseline_escalate_steps` points: a healthy "
              "run on other data can leave a band for a while, a broken recipe stays out")
CHECKED = ("checked on plain PyTorch loops (another seed, another data order, another draw "
           "of the data, a CPU hog beside the job) and GRPO runs against baselines of the same "
           "recipe")


def _step_points(run: RunState, quantity: str) -> Iterator[tuple[int, float]]:
    """(step, value) of a quantity of the run's optimizer steps, newest first, computed as
    the walk asks (it stops at the first step inside the band)."""
    for point in reversed(run.combined_steps()):
        if point.skipped:
            continue
        value = point_value(point, quantity)
        if value is not None:
            yield point.step, value


def _log_points(run: RunState, quantity: str) -> Iterator[tuple[int, float]]:
    return reversed(run.log_history.get(quantity, ()))


def _trajectory(run: RunState, settings: DetectorSettings, quantities: Sequence[str],
                from_logs: bool) -> tuple[Baseline, Deviation | None] | None:
    """The longest-lasting deviation among quantities, the first of equals (None: the run
    names no baseline): a persistent one is not hidden behind a younger one's info."""
    baseline = baseline_of(run)
    if baseline is None:
        return None
    total = total_steps(run, baseline)
    longest: Deviation | None = None
    for quantity in quantities:
        points = _log_points(run, quantity) if from_logs else _step_points(run, quantity)
        found = deviation(baseline, quantity, points, total, settings.baseline_steps,
                          settings.baseline_margin * MARGIN_SCALE.get(quantity, 1.0),
                          settings.baseline_escalate_steps)
        if found is not None and (longest is None or found.points > longest.points):
            longest = found
    return baseline, longest


def persistence(points: int, settings: DetectorSettings) -> tuple[Severity | None, str]:
    """A deviation's severity after points consecutive points out (None: the spec's,
    warning) and the words saying so: info until it lasts ``baseline_escalate_steps``."""
    if points >= settings.baseline_escalate_steps:
        return None, f"; persistent ({points} points)"
    return Severity.INFO, (f"; info until it lasts {settings.baseline_escalate_steps} points "
                           "(a run on other data can leave a band for a while)")


def _verdict(run: RunState, found: tuple[Baseline, Deviation | None] | None, fix: str,
             settings: DetectorSettings) -> Verdict | None:
    if found is None:
        return None
    baseline, dev = found
    if dev is None:
        return Verdict(False, step=run.step)
    severity, words = persistence(dev.points, settings)
    return Verdict(True, step=dev.escalated_step or dev.reached_step, severity=severity,
                   summary=f"{dev.words()} (baseline {baseline.name or 'unnamed'}): {fix}"
                   f"{words}", evidence={**dev.evidence(), "baseline": baseline.name})


#: The healthy runs every baseline detector stayed silent on (no info, no warning): the
#: healthy matrix (no baseline named), its conformance twin, and test_baseline's other seeds,
#: data orders and draws of the data, with and without a CPU hog beside them
#: (``bench/baseline_escalation.py`` measures more of them).
CHECKED_ON = ("healthy-matrix", "conformance-twin", "baseline-healthy-seeds",
              "baseline-other-data", "baseline-busy-machine")


class BaselineRecipeChanged(SpecDetector):
    """The run's recipe differs from its baseline's: what differs, once."""

    spec = DetectorSpec(
        id="baseline_recipe_changed",
        checked_against=CHECKED_ON,
        false_positives=("fires on any recipe field that differs from the baseline's, a "
                         "deliberate change too (another learning rate, another dataset "
                         "size); it is information and pages nobody"),
        severity=Severity.INFO,
        policy=Policy.OBSERVE,
        latching=True,
        summary="Run {run_id} differs in its recipe from the baseline it names",
        meaning="the run's fingerprint (trainer, optimizer settings, model size, what trains, "
        "PEFT settings, data rows, library versions) differs from its baseline's, or the "
        "baseline could not be read; it is still compared on what is comparable",
        fix="check each difference is intended; save a new baseline from a healthy run of the "
        "new recipe (`deadweight baseline save`) when it is",
        fires_when="at the RunStart, when a fingerprint entry of the baseline differs from the "
        "run's (or the baseline sent is unreadable)",
        evidence=(Evidence("step"),),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        found = parsed(run.start)
        if found is None or run.start is None:
            return None
        if isinstance(found, BaselineError):
            return Verdict(True, step=run.step, summary=f"the baseline "
                           f"{run.start.baseline_name or ''} cannot be read ({found}): this run "
                           "is compared with nothing", evidence={"error": str(found)})
        lines = prints.differences(found.fingerprint, prints.fingerprint(run.start))
        if not lines:
            return Verdict(False, step=run.step)
        shown = "; ".join(lines[:prints.MAX_NAMED]) + (
            f"; +{len(lines) - prints.MAX_NAMED} more" if len(lines) > prints.MAX_NAMED else "")
        return Verdict(True, step=run.step,
                       summary=f"the recipe differs from baseline {found.name or 'unnamed'} in "
                       f"{len(lines)} facts: {shown}",
                       evidence={"differences": str(len(lines)), "baseline": found.name,
                                 **{f"diff{i}": line for i, line in
                                    enumerate(lines[:prints.MAX_NAMED], 1)}})


class BaselineModulesChanged(SpecDetector):
    """A module kind moves where the baseline never moved it, or stays put where the
    baseline always moved it: a freeze that did not happen (or one nobody asked for)."""

    spec = DetectorSpec(
        id="baseline_modules_changed",
        checked_against=CHECKED_ON,
        false_positives=("a run that unfreezes a module kind on purpose, a deliberate change"
                         " of recipe the baseline does not know; its evidence names the "
                         "module kind"),
        severity=Severity.WARNING,
        summary="Run {run_id} trains other modules than its baseline",
        meaning="a module kind the baseline never moved moves at every step (a freeze that "
        "never took effect), or one the baseline moved at every step stays byte-identical",
        fix="apply the freeze where the pipeline really runs (`requires_grad_(False)` before "
        "building the optimizer, batch norm in eval mode), or unfreeze the module the "
        "recipe trains",
        fires_when="`baseline_module_steps` consecutive optimizer steps moved a module kind "
        "the baseline never moved, or `baseline_steps` left one unmoved that the baseline "
        f"moved at 90% of its steps or more; {CHECKED}",
        thresholds=(Threshold("baseline_module_steps", "optimizer steps", "consecutive steps "
                              "a module kind the baseline never moved must move"), STEPS),
        evidence=(Evidence("update_norm"), Evidence("trainable_params")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        baseline = baseline_of(run)
        if baseline is None:
            return None
        steps = [p for p in run.combined_steps() if not p.skipped and p.learning_rate > 0]
        if not steps:
            return Verdict(False)
        known = baseline.modules
        unsure = "other" in known  # the baseline's run had too many kinds to name each

        def strangers(point: StepPoint) -> list[tuple[str, float]]:
            moved = []
            for kind, square, elements, _, _ in point.groups.updates:
                name = module_label(kind)
                facts = known.get(name)
                if square > 0 and ((facts is None and not unsure) or
                                   (facts is not None and facts.moved_share == 0)):
                    moved.append((name, update_over_lr(square, elements,
                                                       point.learning_rate) or 0.0))
            return moved

        streak = trailing_streak(steps, lambda p: bool(strangers(p)))
        reached = streak.reached(settings.baseline_module_steps)
        if reached is not None:
            last = streak.items[-1]
            moved = strangers(last)
            names = ", ".join(f"{n} (update ratio {r:.3g})" for n, r in moved[:6])
            return Verdict(True, step=reached.step, summary=(
                f"{names} moved at steps {streak.items[0].step}-{last.step} where baseline "
                f"{baseline.name or 'unnamed'} never moved {'it' if len(moved) == 1 else 'them'}"
                f" (trainable params {run.start.membership.optimizer_params if run.start else 0})"
                ": a freeze did not take effect; freeze before building the optimizer"),
                evidence={"modules": ",".join(n for n, _ in moved[:6]),
                          "update_ratio": fmt(moved[0][1]), "since_step": fmt(
                              streak.items[0].step), "step": fmt(last.step),
                          "baseline": baseline.name})
        always = {n for n, f in known.items() if f.moved_share >= 0.9 and n != "other"}
        if not always:
            return Verdict(False, step=steps[-1].step)

        def still(point: StepPoint) -> set[str]:
            updates = point.groups.updates
            if not updates or len(updates) >= MAX_MODULE_KINDS_PER_STEP:
                return set()  # no groups, or more than a step keeps: absence means nothing
            moving = {module_label(k) for k, square, _, _, _ in updates if square > 0}
            return always - moving

        streak2 = trailing_streak(steps, lambda p: bool(still(p)))
        reached = streak2.reached(settings.baseline_steps)
        if reached is None:
            return Verdict(False, step=steps[-1].step)
        names = ", ".join(sorted(still(streak2.items[-1]))[:6])
        return Verdict(True, step=reached.step, summary=(
            f"{names} stayed unmoved at steps {streak2.items[0].step}-{streak2.items[-1].step} "
            f"where baseline {baseline.name or 'unnamed'} moved it at every step: a module "
            "the recipe trains is frozen"),
            evidence={"modules": names, "since_step": fmt(streak2.items[0].step),
                      "step": fmt(streak2.items[-1].step), "baseline": baseline.name})


class BaselineGradNorm(SpecDetector):
    """The gradient norm leaves the baseline's band and stays out."""

    spec = DetectorSpec(
        id="baseline_grad_norm",
        checked_against=CHECKED_ON,
        false_positives=("a run on other data than the baseline's (the same recipe on "
                         "another dataset) can leave the grad-norm band for the five points "
                         "in a row an info needs; a warning needs it out for "
                         "`baseline_escalate_steps` points"),
        severity=Severity.WARNING,
        lower_severity=Severity.INFO,
        lower_when=LOWER_WHEN,
        summary="Run {run_id}'s gradient norm left its baseline's band",
        meaning="the gradient norm stays above or under the band healthy runs of this recipe "
        "showed at the same point of training (gradients never cleared, another loss scale, "
        "another batch)",
        fix="compare the loop with the baseline's: `optimizer.zero_grad()` every step, the "
        "same loss reduction, batch size and accumulation",
        fires_when=f"`baseline_steps` consecutive points outside the band; {CHECKED}",
        thresholds=(STEPS, ESCALATE, MARGIN),
        evidence=(Evidence("grad_norm"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        baseline = baseline_of(run)
        if baseline is None:
            return None
        logged = "grad_norm" in baseline.series and run.last_logged("grad_norm") is not None
        found = _trajectory(run, settings, ("grad_norm",) if logged else ("grad_l2",), logged)
        return _verdict(run, found, "are gradients cleared every step (`zero_grad`), and is "
                        "the loss and batch the baseline's?", settings)


class BaselineLoss(SpecDetector):
    """The loss leaves the baseline's band and stays out."""

    spec = DetectorSpec(
        id="baseline_loss",
        checked_against=CHECKED_ON,
        false_positives=("a run on other data or another tokenizer than the baseline's "
                         "shifts its loss out of the band while it learns"),
        severity=Severity.WARNING,
        lower_severity=Severity.INFO,
        lower_when=LOWER_WHEN,
        summary="Run {run_id}'s loss left its baseline's band",
        meaning="the loss stays above or under the band healthy runs of this recipe showed at "
        "the same point (a loss falling far faster: the same batch every step, a leak; a "
        "loss on another scale: another loss type)",
        fix="check the data pipeline feeds new batches (shuffling, the iterator advanced each "
        "step) and that the loss type and reduction are the baseline's",
        fires_when=f"`baseline_steps` consecutive logged losses outside the band; {CHECKED}",
        thresholds=(STEPS, ESCALATE, MARGIN),
        evidence=(Evidence("loss"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        return _verdict(run, _trajectory(run, settings, ("loss",), True),
                        "does every step get a new batch, and is the loss the baseline's?",
                        settings)


class BaselineLearningRate(SpecDetector):
    """The learning rate the optimizer steps with leaves the baseline's band."""

    spec = DetectorSpec(
        id="baseline_learning_rate",
        checked_against=CHECKED_ON,
        false_positives=("a schedule or learning rate changed on purpose leaves the band; "
                         "the recipe line says what changed"),
        severity=Severity.WARNING,
        lower_severity=Severity.INFO,
        lower_when=LOWER_WHEN,
        summary="Run {run_id}'s learning rate left its baseline's band",
        meaning="the learning rate the optimizer really uses differs from the schedule healthy "
        "runs of this recipe followed (a scheduler never stepped stays at its warmup value; "
        "a changed default)",
        fix="call `scheduler.step()` after every optimizer step, and check the peak, warmup "
        "and schedule type against the baseline's",
        fires_when=f"`baseline_steps` consecutive optimizer steps outside the band; {CHECKED}",
        thresholds=(STEPS, ESCALATE, MARGIN),
        evidence=(Evidence("learning_rate"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        return _verdict(run, _trajectory(run, settings, ("learning_rate",), False),
                        "is the scheduler stepped after every optimizer step?", settings)


class BaselineUpdateSize(SpecDetector):
    """The per-element size of each update leaves the baseline's band."""

    spec = DetectorSpec(
        id="baseline_update_size",
        checked_against=CHECKED_ON,
        false_positives=("a learning rate or optimizer changed on purpose moves the update "
                         "size out of the band; the recipe line says what changed"),
        severity=Severity.WARNING,
        lower_severity=Severity.INFO,
        lower_when=LOWER_WHEN,
        summary="Run {run_id}'s updates are sized unlike its baseline's",
        meaning="each optimizer step moves the weights (or one module kind's) by far more or "
        "far less per element than healthy runs of this recipe did",
        fix="compare learning rate, optimizer, its epsilon and betas, gradient clipping and "
        "what trains with the baseline's recipe",
        fires_when="`baseline_steps` consecutive optimizer steps outside the band, or a module "
        "kind's update ratio (per-element update over lr) beyond the range the baseline's runs "
        "showed, by a factor of 1 + 4 x `baseline_margin`, at each of the newest "
        f"`baseline_steps` steps; {CHECKED}",
        thresholds=(STEPS, ESCALATE, MARGIN),
        evidence=(Evidence("update_norm"), Evidence("learning_rate")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        fix = "compare the optimizer, its settings and what trains with the baseline's"
        found = _trajectory(run, settings, ("update_rms",), False)
        whole = _verdict(run, found, fix, settings)
        if found is None or whole is None or (whole.firing and whole.severity is None):
            return whole  # no baseline, or the whole update's deviation is persistent
        module = _module_ratio(run, settings, found[0], fix)
        if module is None or (whole.firing and module.severity is not None):
            return whole  # the whole update's deviation, unless a module's lasts longer
        return module


def _module_ratio(run: RunState, settings: DetectorSettings, baseline: Baseline, fix: str
                  ) -> Verdict | None:
    """A module kind whose update ratio (per-element update over lr) lay outside the range
    the baseline's runs showed over their whole length, by more than a factor of 1 + 2 x its
    margin, on one side, at each of the newest ``baseline_steps`` steps (a per-group
    learning rate or clipping that changed); a warning once it has for
    ``baseline_escalate_steps``."""
    # a ratio is positive and the band spans the whole run (Adam's early steps are larger):
    # out means beyond it by a factor, not by its width (which would reach below zero)
    factor = 1.0 + 2.0 * settings.baseline_margin * MARGIN_SCALE["update_rms"]
    #: "name+1" / "name-1" -> (step, ratio) of the trailing steps it lay out on that side,
    #: newest first; a key stays only while every step so far had it out.
    streaks: dict[str, list[tuple[int, float]]] = {}
    walked = 0
    for point in reversed(run.combined_steps()[-max(settings.baseline_steps,
                                                    settings.baseline_escalate_steps):]):
        if point.skipped or point.learning_rate <= 0:
            break
        out: dict[str, tuple[int, float]] = {}
        for kind, square, elements, _, _ in point.groups.updates:
            name = module_label(kind)
            facts = baseline.modules.get(name)
            ratio = update_over_lr(square, elements, point.learning_rate)
            if facts is None or facts.update_over_lr is None or ratio is None:
                continue
            band = facts.update_over_lr
            where = 1 if ratio > band.high * factor else -1 if ratio < band.low / factor else 0
            if where:
                out[f"{name}{where:+d}"] = (point.step, ratio)
        streaks = {key: [*streaks.get(key, []), found] for key, found in out.items()
                   if walked == 0 or key in streaks}
        walked += 1
        if not streaks:
            return None
    for key, newest_first in sorted(streaks.items()):
        if len(newest_first) < settings.baseline_steps:
            continue
        points = newest_first[::-1]
        name, above = key[:-2], key.endswith("+1")
        healthy = baseline.modules[name].update_over_lr
        assert healthy is not None
        step, ratio = points[-1]
        severity, words = persistence(len(points), settings)
        return Verdict(True, step=step, severity=severity, summary=(
            f"{name} update ratio {ratio:.3g} {'above' if above else 'under'} the baseline's band "
            f"{healthy.low:.3g}..{healthy.high:.3g} at steps {points[0][0]}-{step} (baseline "
            f"{baseline.name or 'unnamed'}): {fix}{words}"),
            evidence={"quantity": "update_over_lr", "module": name, "step": str(step),
                      "value": f"{ratio:.6g}", "band_low": f"{healthy.low:.6g}",
                      "band_high": f"{healthy.high:.6g}", "points_outside": str(len(points)),
                      "baseline": baseline.name})
    return None


class BaselineRlSignals(SpecDetector):
    """Reward, its spread, KL or entropy leave the baseline's band, or one is missing."""

    spec = DetectorSpec(
        id="baseline_rl_signals",
        checked_against=(*CHECKED_ON, "baseline-grpo-seeds"),
        false_positives=("a reward function or KL coefficient changed on purpose moves "
                         "reward, reward_std or kl out of the band"),
        severity=Severity.WARNING,
        lower_severity=Severity.INFO,
        lower_when=LOWER_WHEN,
        summary="Run {run_id}'s RL signals left its baseline's band",
        meaning="reward, reward_std, kl or entropy stays outside the band healthy runs of this "
        "recipe showed, or a signal the baseline logged is missing (kl is absent when beta "
        "became 0)",
        fix="compare the RL settings with the baseline's (beta, num_generations, temperature, "
        "reward functions, loss type) and restore the one that changed",
        fires_when="`baseline_steps` consecutive log reports outside the band, or as many "
        f"without a signal the baseline logged; {CHECKED}",
        thresholds=(STEPS, ESCALATE, MARGIN),
        evidence=(Evidence("reward_std"), Evidence("kl"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        baseline = baseline_of(run)
        if baseline is None:
            return None
        logs = run.history("loss") or run.history("reward")
        for quantity in RL_QUANTITIES:
            bands = baseline.series.get(quantity)
            if not bands or run.last_logged(quantity) is not None:
                continue
            if sum(b is not None for b in bands) >= len(bands) // 2 \
                    and len(logs) >= settings.baseline_steps:
                severity, words = persistence(len(logs), settings)
                first = logs[min(len(logs), settings.baseline_escalate_steps
                                 if severity is None else settings.baseline_steps) - 1][0]
                return Verdict(True, step=first, severity=severity, summary=(
                    f"{quantity} not logged in {len(logs)} log reports (steps {logs[0][0]}-"
                    f"{logs[-1][0]}) where baseline {baseline.name or 'unnamed'} logged it "
                    f"(band at the start {bands[0].low if bands[0] else 0:.4g}.."
                    f"{bands[0].high if bands[0] else 0:.4g}): "
                    + ("beta is 0, so nothing anchors the policy; set beta > 0 as the "
                       "baseline did" if quantity == "kl" else
                       "restore the setting that logs it") + words),
                    evidence={"quantity": quantity, "missing_logs": fmt(len(logs)),
                              "step": fmt(logs[-1][0]), "baseline": baseline.name})
        return _verdict(run, _trajectory(run, settings, RL_QUANTITIES, True),
                        "compare beta, num_generations, temperature and the reward functions "
                        "with the baseline's", settings)
