"""Where one rank is inside a step, finer than the optimizer step: for per-rank verdicts.

Ranks of a synchronised job finish each optimizer step together, so a rank stuck in its own
loop and a rank waiting for it in a collective both show the same last optimizer step. Two
marks tell them apart, both from forward hooks on the model (passes with gradients only, so
evaluation does not count), each one attribute write and one clock read on the training
thread:

- the step a rank has *begun* (its first forward pass after an optimizer step, or the
  trainer's step begin): the heartbeats carry it, so the rank that never began the step the
  others are inside is the one named;
- the rank's *local seconds* per step: from the previous optimizer step's end to its last
  forward's end (data loading and forward passes, before the gradient all-reduce where the
  ranks wait for each other), so the rank the others consistently wait for shows.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .stream_client import StreamClient


class StepProgress:
    """Forward hooks on one model that mark the step begun and time the rank's local work."""

    def __init__(self, client: StreamClient, model: Any) -> None:
        self._client = client
        self._since = time.perf_counter()  # the previous optimizer step's end
        self._forward_end = 0.0
        self._handles: list[Any] = []
        register_pre = getattr(model, "register_forward_pre_hook", None)
        register_post = getattr(model, "register_forward_hook", None)
        if callable(register_pre) and callable(register_post):
            self._handles = [register_pre(self._pre), register_post(self._post)]

    def _pre(self, module: Any, args: Any) -> None:
        if torch.is_grad_enabled():
            client = self._client
            client.began_step = max(client.began_step, client.last_step + 1)

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self._forward_end = time.perf_counter()

    def step_done(self) -> float | None:
        """At the optimizer step's end: this step's local seconds (None when no forward pass
        with gradients was seen since the previous step), and the clock starts again."""
        now = time.perf_counter()
        local = self._forward_end - self._since if self._forward_end > self._since else None
        self._since = now
        return local

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

