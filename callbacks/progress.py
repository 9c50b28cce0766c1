"""Where one rank is inside a step, finer than the optimizer step: for per-rank verdicts.

Ranks of a synchronised job finish each optimizer step together, so a rank stuck in its own
loop and a rank waiting for it in a collective both show the same last optimizer step. Marks
below the optimizer step tell them apart, each an attribute write or two and one clock read on
the training thread (no device work, no tensor):

- the *phase* the rank last entered and when: a forward pass with gradients began (a forward
  pre-hook on the model; evaluation and generation do not count), the backward pass began (a
  gradient hook on a few trainable parameters, which receive their gradients first), the
  backward pass ended (a callback the autograd engine runs at its end, queued once per
  backward), the optimizer step ended (the driver's step hook). With the step and micro-batch
  the phase belongs to, the heartbeats carry it, so the rank that stopped behind the others
  is named with the phase it stopped in and since when;
- the step a rank has *begun* (its first forward pass after an optimizer step, or the
  trainer's step begin), for sidecars that read no phase;
- the rank's *local seconds* per step: from the previous optimizer step's end to its last
  forward's end (data loading and forward passes, before the gradient all-reduce where the
  ranks wait for each other), so the rank the others consistently wait for shows.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .stream_client import StreamClient

#: The phases, as the wire numbers them (``Heartbeat.Phase``).
FORWARD = 1
BACKWARD = 2
BACKWARD_DONE = 3
OPTIMIZER_STEP = 4
#: Trainable parameters (the last ones the model lists, the first to receive a gradient in a
#: backward pass) whose gradient hook marks the backward's start: one is enough when it gets
#: a gradient; a few cover a head or an adapter that some steps leave out.
BACKWARD_MARK_PARAMS = 4


def _engine_callback() -> Any:
    """The autograd engine's ``queue_callback`` (runs a function when the current backward
    ends), None where this torch has none."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    return queue if callable(queue) else None


class StepProgress:
    """Hooks on one model that mark the phase of the step each rank is in, the step begun,
    and time the rank's local work."""

    def __init__(self, client: StreamClient, model: Any) -> None:
        self._client = client
        self._since = time.perf_counter()  # the previous optimizer step's end
        self._forward_end = 0.0
        self._handles: list[Any] = []
        #: Bound once: queued at every backward's start without building a new callable.
        self._done = self._backward_done
        self._queue = _engine_callback()
        register_pre = getattr(model, "register_forward_pre_hook", None)
        register_post = getattr(model, "register_forward_hook", None)
        if callable(register_pre) and callable(register_post):
            self._handles = [register_pre(self._pre), register_post(self._post)]
        parameters = getattr(model, "parameters", None)
        trainable = [p for p in parameters() if p.requires_grad] if callable(parameters) else []
        for param in trainable[-BACKWARD_MARK_PARAMS:]:
            register = getattr(param, "register_post_accumulate_grad_hook", None)
            if callable(register):
                try:
                    self._handles.append(register(self._grad_ready))
                except RuntimeError:  # not a leaf here (a wrapper's view): no backward mark
                    continue

    def _pre(self, module: Any, args: Any) -> None:
        if torch.is_grad_enabled():
            client = self._client
            phase = client.phase
            if phase in (BACKWARD, BACKWARD_DONE):
                client.phase_pass += 1  # the next micro-batch of the same step
            elif phase != FORWARD:  # the first forward after an optimizer step
                client.phase_step = max(client.last_step + 1, client.began_step)
                client.phase_pass = 0
            client.began_step = max(client.began_step, client.last_step + 1)
            client.phase_at = time.monotonic()
            client.phase = FORWARD

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self._forward_end = time.perf_counter()

    def _grad_ready(self, param: Any) -> None:
        client = self._client
        if client.phase == FORWARD:
            client.phase_at = time.monotonic()
            client.phase = BACKWARD
            if self._queue is not None:
                try:
                    self._queue(self._done)
                except RuntimeError:  # outside a backward the engine runs: no end mark
                    self._queue = None

    def _backward_done(self) -> None:
        client = self._client
        if client.phase == BACKWARD:
            client.phase_at = time.monotonic()
            client.phase = BACKWARD_DONE

    def step_done(self, step: int) -> tuple[float | None, float]:
        """At optimizer step ``step``'s end: marks the phase, and returns this step's local
        seconds (None when no forward pass with gradients was seen since the previous step)
        and its seconds since the previous step's end; the clock starts again."""
        client = self._client
        client.phase_step = step
        client.phase_pass = 0
        client.phase_at = time.monotonic()
        client.phase = OPTIMIZER_STEP
        now = time.perf_counter()
        local = self._forward_end - self._since if self._forward_end > self._since else None
        period = now - self._since
        self._since = now
        return local, period

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
