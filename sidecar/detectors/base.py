"""The detector contract: a small, pure function of a run's state that returns a verdict.

A detector never acts and never keeps state of its own; the registry remembers verdicts and
turns transitions into actions. Everything else about a detector (id, severity, default
policy, latching, scope, thresholds, alert wording, evidence, runbook) is one ``DetectorSpec``
the class holds as ``spec``; ``SpecDetector`` exposes it under the protocol's names.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Generic, NamedTuple, Protocol, TypeVar

from ...proto import pb
from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from ..model.step_point import StepPoint

# Policy and Severity are re-exported: the registry, actions and CLI import them from here.
from .spec import DetectorSpec, Scope
from .spec import Policy as Policy
from .spec import Severity as Severity

#: A verdict's evidence when it names none (shared: read-only).
NO_EVIDENCE: Mapping[str, str] = MappingProxyType({})


class Verdict(NamedTuple):
    """A detector's answer: firing or not, at which step, and the numbers behind it.

    A named tuple: every detector makes one at every batch of its run (a frozen dataclass
    set its fields one by one and made an empty evidence dict each time)."""

    firing: bool
    step: int = 0
    summary: str = ""
    evidence: Mapping[str, str] = NO_EVIDENCE
    #: The severity this verdict carries when it is not the spec's (None: the spec's). A
    #: detector whose evidence is certain in one case and only likely in another gives the
    #: lower one where a healthy run could produce it, or steps up as a deviation persists;
    #: an incident only ever steps up (``incidents.FindingLifecycle``).
    severity: Severity | None = None


class Detector(Protocol):
    """One silent failure, detected."""

    spec: ClassVar[DetectorSpec]

    @property
    def id(self) -> str: ...

    @property
    def severity(self) -> Severity: ...

    @property
    def default_policy(self) -> Policy: ...

    @property
    def latching(self) -> bool:
        """Whether the verdict stands once given (facts at train begin) or can recover."""
        ...

    @property
    def scope(self) -> Scope:
        """"run" verdicts end with the run; "artifact" ones stand until the run expires."""
        ...

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        """The verdict for run now, or None when there is not enough data to say."""
        ...


class SpecDetector:
    """Base of every detector: the protocol's attributes, read from the class's ``spec``."""

    spec: ClassVar[DetectorSpec]

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def severity(self) -> Severity:
        return self.spec.severity

    @property
    def default_policy(self) -> Policy:
        return self.spec.policy

    @property
    def latching(self) -> bool:
        return self.spec.latching

    @property
    def scope(self) -> Scope:
        return self.spec.scope


def fmt(value: float | int | None) -> str:
    """Evidence values as short, exact-enough text."""
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.6g}"


#: Trainers that sample completions and score them (beta is their KL coefficient).
RL_TRAINERS = frozenset({"GRPOTrainer", "RLOOTrainer"})


#: The evidence key (and the ``fix_cases`` key) telling whether the adapter was made
#: trainable: "true" (``is_trainable=True`` or ``get_peft_model``: PEFT's ``inference_mode``
#: off), "false" (loaded for inference), "unknown" (no adapter, or a client that did not say).
ADAPTER_MADE_TRAINABLE = "adapter_made_trainable"


def adapter_made_trainable(run: RunState) -> str:
    """Whether the run's adapter was loaded or built trainable (see ADAPTER_MADE_TRAINABLE)."""
    mode = run.config.get("adapter_inference_mode")
    if mode is None or run.start is None or not run.start.preflight.is_peft:
        return "unknown"
    return "false" if mode > 0 else "true"


#: The fix when the adapter was made trainable and still holds nothing that trains: something
#: froze it afterwards (PEFT's ``prepare_model_for_kbit_training`` sets ``requires_grad=False``
#: on every parameter).
FROZEN_AFTER_LOAD_FIX = (
    "the adapter was made trainable and frozen afterwards: call "
    "`prepare_model_for_kbit_training` (it sets `requires_grad=False` on every parameter) before "
    "`get_peft_model` / `PeftModel.from_pretrained(..., is_trainable=True)`, never after, and "
    "freeze nothing after the adapter is built")


def is_rl(run: RunState) -> bool:
    """A GRPO/RLOO-style run: named so, or configured with num_generations."""
    return run.trainer in RL_TRAINERS or "num_generations" in run.config


def start_facts_or_silent(run: RunState, fact: str = "") -> pb.RunStart | Verdict | None:
    """The run's start facts, or what a detector over them answers without them: None before
    the RunStart (nothing to judge yet), a silent verdict when the RunStart lacks the optional
    fact (the client could not gather it: the run is watched without it)."""
    if run.start is None:
        return None
    if fact and not run.start.HasField(fact):
        return Verdict(False)
    return run.start


def trainer_loop(run: RunState) -> bool:
    """Whether a transformers Trainer runs the loop (the callback), not the user's own code
    (``deadweight.watch``). What the Trainer does is known: it clears the gradients after
    every step, and it saves a PEFT model through the adapter, so what the adapter leaves
    out is lost from every checkpoint it writes (a raw loop may save the rest itself)."""
    return run.start is not None and run.start.config_text.get("loop") == "trainer"


def _step_of(point: StepPoint) -> int:
    return point.step


def step_at(steps: Sequence[StepPoint], step: int) -> StepPoint | None:
    """The step numbered step among steps (ordered by step, as ``combined_steps``), or None.

    A lookup by bisection: detectors run at every batch and look up a few steps, where a
    ``{p.step: p}`` map of the whole window cost more than the rest of their work."""
    index = bisect_left(steps, step, key=_step_of)
    return steps[index] if index < len(steps) and steps[index].step == step else None


def steps_after(steps: Sequence[StepPoint], step: int) -> Sequence[StepPoint]:
    """The steps numbered above step (a tail of steps, ordered by step), without a walk."""
    return steps[bisect_right(steps, step, key=_step_of):]


def finite_history(run: RunState, key: str) -> list[tuple[int, float]]:
    """(step, value) log entries of key, NaN and inf left out."""
    return [(s, v) for s, v in run.history(key) if math.isfinite(v)]


T = TypeVar("T")


@dataclass(frozen=True)
class Streak(Generic[T]):
    """The trailing run of items (steps, log reports) that met a condition, oldest first."""

    items: tuple[T, ...]

    def __len__(self) -> int:
        return len(self.items)

    def reached(self, length: int) -> T | None:
        """The item at which the streak reached length (None while it is shorter).

        A batch may carry several steps or logs at once: the verdict names the step where
        the condition was met, not the one that happened to arrive last.
        """
        return self.items[length - 1] if 0 < length <= len(self.items) else None


def trailing_streak(items: Sequence[T], met: Callable[[T], bool],
                    skip: Callable[[T], bool] | None = None) -> Streak[T]:
    """Walk items back from the newest while they meet the condition: that streak.

    Items that ``skip`` picks neither count nor break it. The walk stops at the streak's end,
    so a condition read only there (a step's groups, decoded on first read) costs little.
    """
    streak: list[T] = []
    for item in reversed(items):
        if skip is not None and skip(item):
            continue
        if not met(item):
            break
        streak.append(item)
    return Streak(tuple(reversed(streak)))


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def trained_before(run: RunState, step: int) -> bool:
    """Whether an optimizer step that should have moved weights ran at or before step.

    A step counts when its lr was > 0 or it lies past the warmup (so lr 0 by mistake counts,
    warmup's lr-0 first step does not); True when the step history is gone or never came.
    """
    warmup = warmup_steps(run)
    steps = run.combined_steps()
    if not steps or steps[0].step > 1:
        return True
    return any(p.learning_rate > 0 or p.step > warmup for p in steps if p.step <= step)


def warmup_steps(run: RunState) -> int:
    """The run's warmup in optimizer steps (the trainer's resolved value when it sent one)."""
    return int(run.config.get("resolved_warmup_steps", run.config.get("warmup_steps", 0)))
