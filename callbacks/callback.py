"""``DeadweightCallback``: report what the loss curve cannot show to the deadweight sidecar.

One line::

    trainer.add_callback(DeadweightCallback())

=========================  ===============================================================
hook                       what it reports
=========================  ===============================================================
``on_train_begin``         trainer, resolved config, versions, optimizer membership by
                           identity (per adapter), target-module match, embedding rows vs
                           base vocab, the initial adapter digest
``on_optimizer_step``      update L2 of every watched tensor (snapshot taken at
                           ``on_pre_optimizer_step``), unchanged and non-finite tensor
                           counts, params with a grad that the optimizer does not hold,
                           per-adapter and per-module-kind sums, the learning rate
``on_log``                 every numeric key the trainer logged (bounded)
``on_save``                the checkpoint path and the digest of the adapter in memory
``on_train_end``           the run end; the run summary into the output folder and the
                           last checkpoint
(every adapter save)       the run summary beside it, ``trainer.save_model(dir)`` after
                           training included (``promotion.SummaryOnSave``)
=========================  ===============================================================

Settings come from arguments or ``DEADWEIGHT_ADDRESS``, ``DEADWEIGHT_RUN_ID``,
``DEADWEIGHT_TOKEN`` and ``DEADWEIGHT_TLS_CA`` (the CA file for a TCP sidecar). The callback
decides nothing: the sidecar does, and may answer with a STOP (training ends gracefully) or
ABORT (raised at the next hook) directive. After a STOP, ``callback.stopped_by_deadweight``
holds the root cause and reason (None otherwise), and ``trainer.state.log_history`` has an
entry with ``deadweight/stopped_by`` (the root cause's detector id) and
``deadweight/stop_reason``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from . import digest, layout, trainer_logs
from . import summary_writer as promotion
from .adapter_home import adapter_home
from .console import console_logger
from .deferred import DeferredScalar
from .directives import Directives
from .facts import dataset_rows, heads, membership, preflight, resume, stop_token
from .run_probe import (
    DEFAULT_ADDRESS,
    DeadweightAbort,
    RunProbe,
    SidecarRequired,
    default_run_id,
    learning_rate,
    shared_run_id,
    shielded,
)
from .stream_client import ClientSettings, StreamClient
from .update.probe import UpdateProbe

log = logging.getLogger("deadweight")
#: The trainer's console lines: deadweight's own logger and handler, so a script that quiets
#: transformers (``set_verbosity_error()``) still sees every verdict.
console_log = console_logger()

T = TypeVar("T")

#: Longest wait at train end for the sidecar's verdicts, written into the run summary.
SUMMARY_TIMEOUT_SECONDS = 1.0


def _optional_fact(gather: Callable[..., T], *args: Any) -> T | None:
    """A fact that only sharpens a verdict: when gathering it fails (an odd dataset, an
    unreadable checkpoint), the run is reported without it rather than not at all."""
    try:
        return gather(*args)
    except Exception:
        log.debug("deadweight: %s unavailable", gather.__qualname__, exc_info=True)
        return None


def _loss_scale(optimizer: Any) -> torch.Tensor | float | None:
    """The fp16 loss scale of the optimizer's GradScaler, None without one: a copy of the
    scale tensor left on the device (the scaler updates it in place after the step; reading
    it, ``get_scale()``, would wait for the device)."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale.detach().clone()
    get_scale = getattr(scaler, "get_scale", None)
    return float(get_scale()) if callable(get_scale) else None  # not yet scaling: no tensor


def _step_skipped(optimizer: Any, scale_before: torch.Tensor | float | None
                  ) -> bool | DeferredScalar:
    """Whether the optimizer skipped this step: the wrapper says so, or the loss scale backed
    off (a GradScaler lowers it exactly when it finds inf/NaN gradients and skips). The
    scales are compared on the device and read later by the sender thread: no host sync on
    the training thread."""
    if getattr(optimizer, "step_was_skipped", False) is True:
        return True
    after = _loss_scale(optimizer)
    if scale_before is None or after is None:
        return False
    if isinstance(after, torch.Tensor) and isinstance(scale_before, torch.Tensor):
        return DeferredScalar(after < scale_before)
    return float(after) < float(scale_before)


__all__ = ["DEFAULT_ADDRESS", "DeadweightAbort", "DeadweightCallback", "SidecarRequired",
           "default_run_id", "digest", "membership"]


class DeadweightCallback(TrainerCallback):  # type: ignore[misc]
    """Stream optimizer membership, per-step weight updates and trainer logs to the sidecar.

    A thin driver over ``RunProbe`` (the same core ``deadweight.watch`` uses): the Trainer's
    hooks say when a step starts and ends; the config comes from the trainer's arguments.
    """

    def __init__(
        self,
        address: str | None = None,
        run_id: str | None = None,
        token: str | None = None,
        *,
        require_sidecar: bool = False,
        start_timeout_seconds: float = 1.0,
        settings: ClientSettings | None = None,
        tls_ca: str | None = None,
        expected_trainable_pct: tuple[float, float] | None = None,
        frozen_modules: Sequence[str] | None = None,
        baseline: str | os.PathLike[str] | None = None,
    ) -> None:
        """``expected_trainable_pct``: (low, high) percent of the model's parameters the
        optimizer should train (else ``DEADWEIGHT_EXPECTED_TRAINABLE_PCT``, "LOW-HIGH");
        ``frozen_modules``: module names that must not move (else ``DEADWEIGHT_FROZEN_MODULES``);
        ``baseline``: a baseline file of a known-good run of the recipe (else
        ``DEADWEIGHT_BASELINE``), sent to the sidecar, which compares this run with it.
        """
        self._run = RunProbe(address, run_id, token, tls_ca=tls_ca, settings=settings,
                             require_sidecar=require_sidecar,
                             start_timeout_seconds=start_timeout_seconds,
                             console_logger=console_log,
                             expected_trainable_pct=expected_trainable_pct,
                             frozen_modules=frozen_modules, baseline=baseline)
        self._directives = Directives(self._run, "stopping training")
        self._disabled = False
        self._model: Any = None
        self._adalora = False
        self._loss_scale: torch.Tensor | float | None = None
        self._trainer_logs = False
        self._last_checkpoint: tuple[Path, digest.AdapterDigest] | None = None
        #: The trainer's latest global step (written into summaries of later saves).
        self._step = 0

    # -- the settings and state of the core, under the names users and tests read -------------

    @property
    def address(self) -> str:
        return self._run.address

    @property
    def run_id(self) -> str | None:
        return self._run.run_id

    @run_id.setter
    def run_id(self, value: str | None) -> None:
        self._run.run_id = value

    @property
    def client(self) -> StreamClient | None:
        return self._run.client

    @property
    def _probe(self) -> UpdateProbe | None:
        return self._run.update

    @property
    def stopped_by_deadweight(self) -> str | None:
        """Why deadweight stopped this run (its root cause first), None unless it did."""
        return self._directives.stopped_by

    # -- hooks -------------------------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        optimizer: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        # The collectives come first and outside the shield: every rank must take part.
        output_dir = str(args.output_dir or ".")
        self.run_id = shared_run_id(self.run_id or default_run_id(output_dir, time.time()))
        self._directives.agree()
        self._begin(args, state, control, model, optimizer, processing_class, output_dir,
                    kwargs.get("train_dataloader"))

    @shielded
    def _begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any,
        optimizer: Any,
        processing_class: Any,
        output_dir: str,
        train_dataloader: Any = None,
    ) -> None:
        self._model = model
        # AdaLoRA's rank allocation is read every step, on AdaLoRA runs only: the check
        # walks the adapter configs, work other runs need not repeat each step.
        self._adalora = preflight.adalora_allocated(model) is not None
        self._trainer_logs = trainer_logs.run_first(self)  # loggers then see our keys
        if int(getattr(args, "process_index", 0)) == 0 and model is not None:
            promotion.SummaryOnSave(self._summary_beside).install(model)
        self._run.start(
            model,
            optimizer,
            rank=int(getattr(args, "process_index", 0)),
            world_size=int(getattr(args, "world_size", 1)),
            output_dir=output_dir,
            trainer=preflight.trainer_name(args),
            config={**preflight.numeric_config(args, int(state.max_steps or 0)),
                    **preflight.adapter_numbers(model)},
            # the Trainer clears the gradients after every optimizer step itself
            config_text={**preflight.text_config(args), "loop": "trainer"},
            preflight=preflight.gather(model, processing_class),
            requested_wrapper=layout.requested_wrapper(args),
            stop_token=_optional_fact(stop_token.check, train_dataloader, processing_class,
                                       model),
            heads=_optional_fact(heads.check, model),
            resume=_optional_fact(resume.check, output_dir, int(state.global_step or 0)),
            dataset_rows=_optional_fact(dataset_rows.count, train_dataloader),
        )
        self._apply_directives(control, state)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._look(control, state)
        self._began(state.global_step + 1)

    @shielded
    def _began(self, step: int) -> None:
        self._run.began(step)  # the rank's data is loaded and it begins the step

    @shielded
    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._run.evaluated()  # an evaluation batch done: progress, though no optimizer step

    @shielded
    def on_pre_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        self._loss_scale = _loss_scale(optimizer)
        self._run.before_step(learning_rate(optimizer, lr_scheduler))

    @shielded
    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._step = state.global_step + 1
        self._run.after_step(
            state.global_step + 1,  # global_step advances after this hook
            optimizer_step_skipped=_step_skipped(kw.get("optimizer"), self._loss_scale),
            adalora_rank_pattern_set=(preflight.adalora_allocated(self._model)
                                      if self._adalora else None),
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._look(control, state)
        if self._directives.step_end():
            control.should_training_stop = True  # every rank, after this same step

    @shielded
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.client is None or not logs:
            return
        self._run.log(state.global_step, logs)
        if self._trainer_logs:
            logs.update(self._run.logger_keys())  # after sending: the sidecar has its own
        self._apply_directives(control, state)

    @shielded
    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        path = Path(args.output_dir or ".") / f"checkpoint-{state.global_step}"
        self._run.checkpoint(state.global_step, path, model)
        self._last_checkpoint = (path, digest.digest_adapter(model))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._directives.close()
        self._end(args, state, control, kw.get("model"))

    @shielded
    def _end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
             model: Any) -> None:
        reason = "stopped" if control.should_training_stop else "completed"
        if state.max_steps and state.global_step >= state.max_steps:
            reason = "completed"
        self._run.end(state.global_step, reason)
        if int(getattr(args, "process_index", 0)) == 0 and self.run_id and model is not None:
            self._write_summary(Path(args.output_dir or "."), state.global_step, model)

    def _write_summary(self, output_dir: Path, step: int, model: Any) -> None:
        """The promotion gate's record with the run's final verdicts, in the output folder
        and the last checkpoint (a later ``save_model`` writes its own, ``_summary_beside``)."""
        self._step = step
        folders = [(output_dir, digest.digest_adapter(model))]
        if self._last_checkpoint is not None:
            folders.append(self._last_checkpoint)
        for folder, adapter in folders:
            self._summary_at(folder, adapter)

    def _summary_beside(self, folder: Path, model: Any,
                        embedding_layers: digest.EmbeddingLayers = "auto") -> None:
        """After any save of the adapter (the wrapped ``save_pretrained``): its summary, over
        the tensors that save wrote (``save_embedding_layers``)."""
        if self.run_id and not self._disabled:
            self._summary_at(folder, digest.digest_adapter(model, embedding_layers))

    def _summary_at(self, folder: Path, adapter: digest.AdapterDigest) -> None:
        folder = adapter_home(folder, self._model)  # a named adapter is saved in its folder
        promotion.write_beside(folder, adapter, str(self.run_id), self._step, self.address,
                               self._run.token, self._run.tls_root(),
                               timeout=SUMMARY_TIMEOUT_SECONDS)

    def _disable(self, hook: str) -> None:
        """Log our failure once and stop monitoring this run; training goes on."""
        self._disabled = True
        log.exception("deadweight: %s failed; monitoring is off for this run, training "
                      "continues", hook)
        self._run.shut_off()

    # -- directives --------------------------------------------------------------------------

    @shielded
    def _look(self, control: TrainerControl, state: TrainerState) -> None:
        self._apply_directives(control, state)

    def _apply_directives(self, control: TrainerControl, state: TrainerState) -> None:
        """The Trainer's act on a STOP (``directives``): the mark in the log history, then
        ``should_training_stop`` (at once, or at the step end every rank agreed on)."""
        stopped = self._directives.look()
        if stopped is None:
            return
        state.log_history.append({
            "deadweight/stopped_by": stopped.root,
            "deadweight/stop_reason": stopped.mark,
            "step": state.global_step,
        })
        if stopped.now:
            control.should_training_stop = True
