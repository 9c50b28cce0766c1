"""``deadweight.watch``: the callback's measurements for any PyTorch training loop.

::

    with deadweight.watch(model, optimizer) as monitor:
        for step, batch in enumerate(loader, start=1):
            loss = model(batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss, grad_norm=norm)

Call it after wrapping (DDP, ``fully_shard``, FSDP, ``accelerator.prepare``,
``deepspeed.initialize``) and after building the optimizer: membership is measured at once,
against the objects that will really train. Every optimizer step is measured through the
optimizer's own step hooks, so the loop needs no per-step call; ``log`` carries what only
the loop knows (loss, grad norm, reward). Optimizers without step hooks (DeepSpeed's ZeRO
optimizers) get their ``step`` wrapped on the instance instead; ``close`` restores it.

Same guarantees as the callback: nothing blocks or raises into the loop except ABORT from the
sidecar (raised from ``optimizer.step()``) and ``require_sidecar=True`` at start. STOP sets
``monitor.should_stop``; on a multi-rank run every rank sees it after the same step;
``monitor.stopped_by_deadweight`` then holds the root cause and reason (None otherwise).
The console lines (run id at start, each verdict, the summary at close) go through Python's
``logging`` under the ``deadweight`` logger.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from . import digest, layout
from . import summary_writer as promotion
from .deferred import defer
from .directives import Directives
from .facts import preflight
from .run_probe import (
    FAILED,
    DeadweightAbort,
    RunProbe,
    default_run_id,
    learning_rate,
    rank_and_world,
    shared_run_id,
    shielded,
)
from .stream_client import ClientSettings, StreamClient

log = logging.getLogger("deadweight")

#: Longest wait for the sidecar's signed run summary at a save.
SUMMARY_TIMEOUT_SECONDS = 1.0


def _scalar(value: Any) -> Any:
    """A one-element tensor (the loop's loss usually is one) as a value the sender thread
    reads: the loop never waits for its device (``deferred``); anything else as is."""
    return defer(value)


class Monitor:
    """One rank of a raw-loop run, reported to the sidecar; build it with ``watch``."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        run_id: str | None = None,
        address: str | None = None,
        *,
        token: str | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        trainer: str = "",
        config: dict[str, float] | None = None,
        settings: ClientSettings | None = None,
        tls_ca: str | None = None,
        require_sidecar: bool = False,
        start_timeout_seconds: float = 1.0,
        expected_trainable_pct: tuple[float, float] | None = None,
        frozen_modules: Sequence[str] | None = None,
        baseline: str | os.PathLike[str] | None = None,
        stop_how: str = "monitor.should_stop is set",
    ) -> None:
        """stop_how: what a STOP does here, in the console's words (a driver over the
        monitor, such as Lightning's, names its own flag)."""
        self.model = model
        self.optimizer = optimizer
        self.step = 0
        #: The newest step the loop logged (a checkpoint names it when no step ran).
        self._logged_step = 0
        self.should_stop = False
        self._run = RunProbe(address, run_id, token, tls_ca=tls_ca, settings=settings,
                             require_sidecar=require_sidecar,
                             start_timeout_seconds=start_timeout_seconds,
                             expected_trainable_pct=expected_trainable_pct,
                             frozen_modules=frozen_modules, baseline=baseline)
        self._directives = Directives(self._run, stop_how)
        self._disabled = False
        self._closed = False
        self._undo: list[Callable[[], None]] = []
        self._rank = 0
        rank, world = rank_and_world()
        folder = str(output_dir) if output_dir is not None else ""
        name = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "run"
        # Collectives first and outside the shield: every rank takes part.
        self._run.run_id = shared_run_id(
            self._run.run_id or default_run_id(folder or name, time.time()))
        self._directives.agree()
        self._start(rank, world, folder, trainer, config or {})
        inner = layout.inner_optimizer(optimizer)
        if not self._disabled and callable(getattr(inner, "step", None)):
            self._hook(inner)

    # -- what the loop calls -----------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return str(self._run.run_id)

    @property
    def client(self) -> StreamClient | None:
        return self._run.client

    @property
    def stopped_by_deadweight(self) -> str | None:
        """Why deadweight stopped this run (its root cause first), None unless it did."""
        return self._directives.stopped_by

    @shielded
    def log(self, step: int, **scalars: Any) -> None:
        """Report the loop's numbers for a step (loss, grad_norm, reward, ...); never blocks.

        Count steps as optimizer steps (``monitor.step`` does) so logs and updates line up.
        """
        self._logged_step = max(self._logged_step, int(step))
        self._run.log(int(step), {k: _scalar(v) for k, v in scalars.items()})
        self._apply_directives()

    @shielded
    def checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Report a checkpoint the loop wrote (after its files are on disk), at the loop's
        step: its optimizer steps, or the step it logged when that is further on (a loop
        whose optimizer never stepped still names where it was). The run summary goes beside
        it (a ``save_pretrained`` of the model writes its own as well)."""
        self._run.checkpoint(max(self.step, self._logged_step), path,
                             layout.unwrap_model(self.model))
        folder = Path(path)
        self._summary_beside(folder if folder.is_dir() else folder.parent,
                             layout.unwrap_model(self.model))

    def _summary_beside(self, folder: Path, model: Any,
                        embedding_layers: digest.EmbeddingLayers = "auto") -> None:
        """The run's signed summary beside an adapter the loop saved (rank 0; also after
        ``close``: a loop saves its final adapter after the loop), over the tensors that save
        wrote (``save_embedding_layers``)."""
        if self._disabled or self._rank != 0:
            return
        promotion.write_beside(folder, digest.digest_adapter(model, embedding_layers),
                               self.run_id, self.step, self._run.address, self._run.token,
                               self._run.tls_root(), timeout=SUMMARY_TIMEOUT_SECONDS)

    def close(self, reason: str = "completed") -> None:
        """Remove the hooks, report the run end and flush (at most 2 s); idempotent."""
        if self._closed:
            return
        self._closed = True
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._directives.close()
        self._end(reason)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close("stopped" if self.should_stop else "completed")
        else:
            self.close("aborted" if exc_type is DeadweightAbort else FAILED)

    # -- hooks -------------------------------------------------------------------------------

    @shielded
    def _start(self, rank: int, world: int, output_dir: str, trainer: str,
               config: dict[str, float]) -> None:
        model = layout.unwrap_model(self.model)
        self._rank = rank
        if rank == 0:  # any save_pretrained of the adapter, in the loop or after it
            promotion.SummaryOnSave(self._summary_beside).install(model)
        self._run.start(
            self.model,
            self.optimizer,
            rank=rank,
            world_size=world,
            output_dir=output_dir,
            trainer=trainer or type(model).__name__,
            config={**_optimizer_config(self.optimizer), **preflight.adapter_numbers(model),
                    **config},
            config_text={"loop": "watch",
                         "optimizer": type(layout.inner_optimizer(self.optimizer)).__name__},
            preflight=preflight.gather(model),
            outermost=True,  # the loop hands over the object it runs
        )
        self._apply_directives()

    def _hook(self, inner: Any) -> None:
        """Optimizer step hooks; a ``step`` wrapper on the instance where there are none."""
        pre, post = self._before_step, self._after_step
        if callable(getattr(inner, "register_step_pre_hook", None)):
            handles = [inner.register_step_pre_hook(lambda opt, args, kwargs: pre()),
                       inner.register_step_post_hook(lambda opt, args, kwargs: post())]
            self._undo += [h.remove for h in handles]
            return
        original = inner.step

        def step(*args: Any, **kwargs: Any) -> Any:
            pre()
            result = original(*args, **kwargs)
            post()
            return result

        inner.step = step

        def restore() -> None:
            if inner.__dict__.get("step") is step:
                del inner.step

        self._undo.append(restore)

    def _before_step(self) -> None:
        self._pre()

    @shielded
    def _pre(self) -> None:
        self._apply_directives()
        self._run.before_step(learning_rate(layout.inner_optimizer(self.optimizer)))

    def _after_step(self) -> None:
        self.step += 1
        self._post()
        if self._directives.step_end():
            self.should_stop = True  # every rank, after this same step

    @shielded
    def _post(self) -> None:
        self._run.after_step(self.step)
        self._apply_directives()

    @shielded
    def _end(self, reason: str) -> None:
        self._run.end(self.step, reason)

    def _disable(self, hook: str) -> None:
        """Log our failure once and stop monitoring this run; training goes on."""
        self._disabled = True
        log.exception("deadweight: %s failed; monitoring is off for this run, training "
                      "continues", hook)
        self._run.shut_off()

    def _apply_directives(self) -> None:
        """The loop's act on a STOP (``directives``): ``should_stop``, at once or at the
        step end every rank agreed on; an ABORT raises from here into the loop."""
        stopped = self._directives.look()
        if stopped is not None and stopped.now:
            self.should_stop = True


def _optimizer_config(optimizer: Any) -> dict[str, float]:
    """The first param group's learning rate and weight decay, as the Trainer config has them."""
    groups = getattr(layout.inner_optimizer(optimizer), "param_groups", None) or [{}]
    config: dict[str, float] = {}
    for key, name in (("lr", "learning_rate"), ("weight_decay", "weight_decay")):
        value = groups[0].get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            config[name] = float(value)
    return config


def watch(model: Any, optimizer: Any, run_id: str | None = None, address: str | None = None,
          **options: Any) -> Monitor:
    """Monitor a training loop: call after wrapping the model and building the optimizer.

    On a multi-rank job call it on every rank (it agrees on rank 0's run id and sets up the
    stop agreement with one collective each).

    Keyword options: ``token``, ``output_dir`` (the folder the sidecar watches for
    checkpoints), ``trainer`` (a name for the run's kind), ``config``, ``settings``,
    ``tls_ca``, ``require_sidecar``, ``start_timeout_seconds``, ``expected_trainable_pct``
    ((low, high) percent of the model's parameters that should train), ``frozen_modules``
    (module names that must not move) and ``baseline`` (a baseline file of a known-good run
    of the recipe, else ``DEADWEIGHT_BASELINE``: the sidecar compares the run with it).
    Address, run id and token
    default to ``DEADWEIGHT_ADDRESS``, ``DEADWEIGHT_RUN_ID`` and ``DEADWEIGHT_TOKEN``.
    """
    return Monitor(model, optimizer, run_id, address, **options)
