"""Detectors over optimizer membership: parameters that should train but never can."""

from __future__ import annotations

from deadweight.sidecar.detectors.base import Policy, Severity, Verdict, fmt
from deadweight.sidecar.settings import DetectorSettings
from deadweight.sidecar.state import RunState


class EmptyOptimizer:
    """At train begin the optimizer holds no parameters: nothing this run does can train.

    The classic cause is ``PeftModel.from_pretrained(base, path)`` without
    ``is_trainable=True``: every adapter tensor is frozen when the optimizer is built.
    """

    id = "empty_optimizer"
    severity = Severity.CRITICAL
    default_policy = Policy.PAGE
    latching = True

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        m = run.start.membership
        if m.optimizer_tensors > 0:
            return Verdict(False)
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
                "step": "0 (train begin)",
            },
        )
