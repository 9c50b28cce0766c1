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
``on_train_end``           the run end
=========================  ===============================================================

Settings come from arguments or ``DEADWEIGHT_ADDRESS``, ``DEADWEIGHT_RUN_ID``,
``DEADWEIGHT_TOKEN`` and ``DEADWEIGHT_TLS_CA`` (the CA file for a TCP sidecar). The callback
decides nothing: the sidecar does, and may answer with a STOP (training ends gracefully) or
ABORT (raised at the next hook) directive.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from deadweight.callbacks import digest, membership, preflight
from deadweight.callbacks.stop_agreement import StopAgreement
from deadweight.callbacks.stream_client import ClientSettings, StreamClient
from deadweight.callbacks.update_probe import UpdateProbe
from deadweight.callbacks.wire import (
    CheckpointRecord,
    RunEndRecord,
    RunStartRecord,
    StepRecord,
    numeric_logs,
    to_event,
)
from deadweight.proto import pb
from deadweight.proto.kinds import EventKind
from deadweight.proto.transport import grpc_target, unix_socket_path

log = logging.getLogger("deadweight")

DEFAULT_ADDRESS = "unix:///run/deadweight/deadweight.sock"


def _may_be_listening(address: str) -> bool:
    """False when the address is a unix socket path that does not exist: no need to wait."""
    path = unix_socket_path(grpc_target(address))
    return path is None or Path(path).exists()


class SidecarRequired(RuntimeError):
    """Raised at train begin when ``require_sidecar=True`` and no sidecar answered."""


def _shielded(hook: Callable[..., None]) -> Callable[..., None]:
    """Run a monitoring hook; a failure of ours turns monitoring off, never training.

    Only the two deliberate exceptions pass: ABORT from the sidecar and a missing sidecar
    the user said is required.
    """

    @functools.wraps(hook)
    def guarded(self: DeadweightCallback, *args: Any, **kwargs: Any) -> None:
        if self._disabled:
            return
        try:
            hook(self, *args, **kwargs)
        except (DeadweightAbort, SidecarRequired):
            raise
        except Exception:
            self._disable(hook.__name__)

    return guarded


class DeadweightAbort(RuntimeError):
    """Raised inside training when the sidecar sent an ABORT directive."""


def default_run_id(output_dir: str, started: float) -> str:
    """A stable, readable id: the output folder's name and a short hash of path and time.

    The name is cut and cleaned so the id always passes the sidecar's checks (at most 128
    printable characters): a long or odd folder name must not leave the run unmonitored.
    """
    path = str(Path(output_dir).resolve())
    tag = hashlib.sha256(f"{path}|{started:.6f}".encode()).hexdigest()[:8]
    name = "".join(c if c.isprintable() else "_" for c in Path(path).name[:100]) or "run"
    return f"{name}-{tag}"


def _shared_run_id(run_id: str) -> str:
    """Every rank must report under rank 0's id; broadcast it when a process group is up."""
    try:
        import torch.distributed as dist
    except ImportError:
        return run_id
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return run_id
    box = [run_id]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _learning_rate(optimizer: Any, lr_scheduler: Any) -> float:
    """The learning rate the coming optimizer step uses."""
    last = getattr(lr_scheduler, "get_last_lr", None)
    if callable(last):
        values = last()
        if values:
            return float(values[0])
    for group in getattr(optimizer, "param_groups", []) or []:
        return float(group.get("lr", 0.0))
    return 0.0


class DeadweightCallback(TrainerCallback):  # type: ignore[misc]
    """Stream optimizer membership, per-step weight updates and trainer logs to the sidecar."""

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
    ) -> None:
        self.address = address or os.environ.get("DEADWEIGHT_ADDRESS") or DEFAULT_ADDRESS
        self.tls_ca = tls_ca or os.environ.get("DEADWEIGHT_TLS_CA") or None
        self.run_id = run_id or os.environ.get("DEADWEIGHT_RUN_ID") or None
        self.token = token or os.environ.get("DEADWEIGHT_TOKEN") or None
        self.require_sidecar = require_sidecar
        self.start_timeout_seconds = start_timeout_seconds
        self.settings = settings or ClientSettings()
        self.client: StreamClient | None = None
        self._probe: UpdateProbe | None = None
        self._membership: membership.Membership | None = None
        self._lr = 0.0
        self._abort: str | None = None
        self._agreement: StopAgreement | None = None
        self._stop_proposed = False
        self._disabled = False

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
        self.run_id = _shared_run_id(self.run_id or default_run_id(output_dir, time.time()))
        self._agreement = StopAgreement.create()
        self._begin(args, state, control, model, optimizer, processing_class, output_dir)

    @_shielded
    def _begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any,
        optimizer: Any,
        processing_class: Any,
        output_dir: str,
    ) -> None:
        run_id = str(self.run_id)
        self._membership = membership.measure(model, optimizer)
        self._probe = UpdateProbe(self._membership.watched, self._membership.groups)
        record = RunStartRecord(
            trainer=preflight.trainer_name(args),
            world_size=int(getattr(args, "world_size", 1)),
            output_dir=str(Path(output_dir).resolve()),
            config=preflight.numeric_config(args, int(state.max_steps or 0)),
            config_text=preflight.text_config(args),
            versions=preflight.versions(),
            membership=self._membership,
            preflight=preflight.gather(model, processing_class),
            initial_adapter=digest.digest_adapter(model),
            host=socket.gethostname(),
        )
        self.client = StreamClient(
            self.address,
            run_id,
            int(getattr(args, "process_index", 0)),
            to_event,
            token=self.token,
            settings=self.settings,
            tls_ca=self.tls_ca,
        )
        self.client.start(record)
        wait = self.start_timeout_seconds if _may_be_listening(self.address) else 0.0
        if self.client.wait_connected(wait):
            self.client.wait_registered(self.start_timeout_seconds)
        elif self.require_sidecar:
            self.client.close(timeout=0.0)
            raise SidecarRequired(
                f"deadweight: no sidecar answered at {self.address} within "
                f"{self.start_timeout_seconds}s and require_sidecar=True"
            )
        self._apply_directives(control)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._directives(control)

    @_shielded
    def on_pre_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        if self._probe is None:
            return
        self._lr = _learning_rate(optimizer, lr_scheduler)
        self._probe.before_step()

    @_shielded
    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._probe is None or self.client is None or self._membership is None:
            return
        stats = self._probe.after_step()
        if stats is None:
            return
        tensors, params = membership.grads_outside_optimizer(self._membership.outside_optimizer)
        step = state.global_step + 1  # global_step advances after this hook
        self.client.last_step = step
        self.client.submit(
            EventKind.STEP,
            StepRecord(
                step=step,
                learning_rate=self._lr,
                stats=stats,
                optimizer_params=self._membership.optimizer_params,
                grad_not_in_optimizer_tensors=tensors,
                grad_not_in_optimizer_params=params,
            ),
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._directives(control)
        if self._agreement is not None and self._agreement.step_end(self._stop_proposed):
            control.should_training_stop = True  # every rank, after this same step

    @_shielded
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
        self.client.submit(EventKind.LOG, numeric_logs(logs, state.global_step))
        self._apply_directives(control)

    @_shielded
    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.client is None:
            return
        path = Path(args.output_dir or ".").resolve() / f"checkpoint-{state.global_step}"
        self.client.submit(
            EventKind.CHECKPOINT,
            CheckpointRecord(state.global_step, str(path), digest.digest_adapter(model)),
        )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._agreement is not None:
            self._agreement.close()
        self._end(state, control)

    @_shielded
    def _end(self, state: TrainerState, control: TrainerControl) -> None:
        if self.client is None:
            return
        reason = "stopped" if control.should_training_stop else "completed"
        if state.max_steps and state.global_step >= state.max_steps:
            reason = "completed"
        self.client.submit(EventKind.RUN_END, RunEndRecord(state.global_step, reason))
        self.client.close(timeout=2.0)

    def _disable(self, hook: str) -> None:
        """Log our failure once and stop monitoring this run; training goes on."""
        self._disabled = True
        log.exception("deadweight: %s failed; monitoring is off for this run, training "
                      "continues", hook)
        self._probe = None
        client, self.client = self.client, None
        if client is not None:
            client.close(timeout=0.0)

    # -- directives --------------------------------------------------------------------------

    @_shielded
    def _directives(self, control: TrainerControl) -> None:
        self._apply_directives(control)

    def _apply_directives(self, control: TrainerControl) -> None:
        """STOP ends training gracefully; ABORT raises inside the training loop."""
        if self._abort is not None:
            raise DeadweightAbort(self._abort)
        if self.client is None:
            return
        for directive in self.client.take_directives():
            reason = f"deadweight {directive.detector}: {directive.reason}"
            if directive.action == pb.Directive.ACTION_STOP and self._agreement is not None:
                if not self._stop_proposed:  # ranks see it a step apart: agree on one step
                    log.warning("%s; stopping training on every rank", reason)
                self._stop_proposed = True
            elif directive.action == pb.Directive.ACTION_STOP:
                if not control.should_training_stop:
                    log.warning("%s; stopping training", reason)
                control.should_training_stop = True
            elif directive.action == pb.Directive.ACTION_ABORT:
                self._abort = reason
                raise DeadweightAbort(reason)
