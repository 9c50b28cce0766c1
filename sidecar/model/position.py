"""How far one rank of a run got: a phase inside a step (heartbeats), the step it began, or
its last optimizer step, as one mark the ranks of a run can be compared by."""

from __future__ import annotations

from dataclasses import dataclass

#: The phases of a step a rank reports (``Heartbeat.Phase`` numbers), in the order it goes
#: through them, by the names verdicts and metrics use.
PHASES = {1: "forward", 2: "backward", 3: "backward_done", 4: "optimizer_step"}
OPTIMIZER_PHASE = 4
#: The micro-batch of an optimizer step's own mark: after every pass of its step.
AFTER_ALL_PASSES = 1 << 30
#: Where a position comes from when no phase was reported: the step begun.
BEGAN = "began"


@dataclass(frozen=True)
class Position:
    """How far one rank got, comparable between the ranks of a run: ``key`` orders (step,
    micro-batch, phase); ``phase`` names it, ``time`` is when the rank got there (0: never)."""

    key: tuple[int, int, int]
    step: int
    phase: str
    time: float

    @property
    def progress_steps(self) -> float:
        """The position as one number: the last optimizer step, plus .1 once the next step
        began, .25 in its forward pass, .5 in its backward, .75 after it (micro-batches not
        told apart)."""
        fraction = {BEGAN: 0.1, "forward": 0.25, "backward": 0.5, "backward_done": 0.75,
                    "optimizer_step": 1.0}[self.phase]
        return self.step - 1 + fraction

    def words(self) -> str:
        """"the backward pass of step 6", "optimizer step 5", "step 6 (begun)"."""
        if self.phase == "optimizer_step":
            return f"optimizer step {self.step}"
        if self.phase == BEGAN:
            return f"the start of step {self.step}"
        what = {"forward": "forward pass", "backward": "backward pass",
                "backward_done": "gradient sync after the backward pass"}[self.phase]
        micro = f" (micro-batch {self.key[1] + 1})" if self.key[1] else ""
        return f"the {what} of step {self.step}{micro}"
