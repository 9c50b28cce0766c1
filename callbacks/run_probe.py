"""The framework-free core of the training side: one run's measurements on one rank.

``RunProbe`` holds everything that does not depend on who drives the loop: the layout and
optimizer membership at start, the update of every optimizer step, logs, checkpoints and the
run end, handed to the stream client without blocking. The Trainer callback, the raw-loop
``watch`` and the Lightning callback are thin drivers over it: they only say when a step
starts and ends, and what the config was.

``shielded`` is the one rule every driver follows: a failure of ours turns monitoring off
with one log line; training goes on. Only ABORT from the sidecar and a missing sidecar the
user said is required pass through.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from ..proto import pb
from ..proto.kinds import EventKind
from ..proto.transport import grpc_target, unix_socket_path
from . import baseline_file, digest, trainer_logs
from . import layout as layouts
from .console import Console
from .deferred import DeferredScalar
from .facts import membership, optimizer_setup, trainable
from .facts.heads import HeadFacts
from .facts.preflight import PreflightFacts
from .facts.preflight import versions as preflight_versions
from .facts.resume import ResumeFacts
from .facts.stop_token import StopTokenFacts
from .file_access import share_with_group
from .loop_exit import LoopWatch, enclosing_loop
from .progress import StepProgress
from .stream_client import ClientSettings, StreamClient
from .update.probe import UpdateProbe
from .update.replica import ReplicaSampler
from .update.replica import due as replica_due
from .update.stats import PendingStats
from .wire import (
    CheckpointRecord,
    RunEndRecord,
    RunStartRecord,
    StepRecord,
    numeric_logs,
    to_event,
)

log = logging.getLogger("deadweight")

DEFAULT_ADDRESS = "unix:///run/deadweight/deadweight.sock"
#: The end reason of a run whose loop raised.
FAILED = "failed"


class SidecarRequired(RuntimeError):
    """Raised at start when ``require_sidecar=True`` and no sidecar answered."""


class DeadweightAbort(RuntimeError):
    """Raised inside training when the sidecar sent an ABORT directive."""


class _Shieldable(Protocol):
    _disabled: bool

    def _disable(self, hook: str) -> None: ...


_S = TypeVar("_S", bound=_Shieldable)


def shielded(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Run a monitoring hook; a failure of ours turns monitoring off, never training."""

    @functools.wraps(hook)
    def guarded(self: _Shieldable, *args: Any, **kwargs: Any) -> Any:
        if self._disabled:
            return None
        try:
            return hook(self, *args, **kwargs)
        except (DeadweightAbort, SidecarRequired):
            raise
        except Exception:
            self._disable(hook.__name__)
            return None

    return guarded


def default_run_id(output_dir: str, started: float) -> str:
    """A stable, readable id: the output folder's name and a short hash of path and time.

    The name is cut and cleaned so the id always passes the sidecar's checks (at most 128
    printable characters): a long or odd folder name must not leave the run unmonitored.
    """
    path = str(Path(output_dir).resolve())
    tag = hashlib.sha256(f"{path}|{started:.6f}".encode()).hexdigest()[:8]
    name = "".join(c if c.isprintable() else "_" for c in Path(path).name[:100]) or "run"
    return f"{name}-{tag}"


def shared_run_id(run_id: str) -> str:
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


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 without a process group)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


def learning_rate(optimizer: Any, lr_scheduler: Any = None) -> float:
    """The learning rate the coming optimizer step uses."""
    last = getattr(lr_scheduler, "get_last_lr", None)
    if callable(last):
        values = last()
        if values:
            return float(values[0])
    for group in getattr(optimizer, "param_groups", []) or []:
        if optimizer_setup.relative_step(group):  # it ignores group["lr"] (None there)
            return optimizer_setup.relative_step_size(optimizer, group)
        lr = group.get("lr", 0.0)
        return float(lr) if isinstance(lr, int | float) else 0.0
    return 0.0


def may_be_listening(address: str) -> bool:
    """False when the address is a unix socket path that does not exist: no need to wait."""
    path = unix_socket_path(grpc_target(address))
    return path is None or Path(path).exists()


class RunProbe:
    """One (run, rank): membership at start, every step's update, logs, checkpoints, the end."""

    def __init__(
        self,
        address: str | None = None,
        run_id: str | None = None,
        token: str | None = None,
        *,
        tls_ca: str | None = None,
        settings: ClientSettings | None = None,
        require_sidecar: bool = False,
        start_timeout_seconds: float = 1.0,
        console_logger: logging.Logger | None = None,
        expected_trainable_pct: tuple[float, float] | None = None,
        frozen_modules: Sequence[str] | None = None,
        baseline: str | os.PathLike[str] | None = None,
    ) -> None:
        #: The known-good run this one is compared with: (content, file name), or None.
        self.baseline = baseline_file.read(baseline)
        self.expected_trainable_pct = trainable.resolve_band(expected_trainable_pct)
        self.frozen_modules = trainable.resolve_frozen(frozen_modules)
        self.address = address or os.environ.get("DEADWEIGHT_ADDRESS") or DEFAULT_ADDRESS
        self.tls_ca = tls_ca or os.environ.get("DEADWEIGHT_TLS_CA") or None
        self.run_id = run_id or os.environ.get("DEADWEIGHT_RUN_ID") or None
        self.token = token or os.environ.get("DEADWEIGHT_TOKEN") or None
        self.settings = settings or ClientSettings()
        self.require_sidecar = require_sidecar
        self.start_timeout_seconds = start_timeout_seconds
        self.client: StreamClient | None = None
        self.update: UpdateProbe | None = None
        self.membership: membership.Membership | None = None
        self.layout: layouts.Layout | None = None
        #: Step-begin marks and local seconds (forward hooks), and the replica sample: on
        #: runs of several ranks only, replicas on unsharded layouts only.
        self.progress: StepProgress | None = None
        self.replicas: ReplicaSampler | None = None
        self._lr = 0.0
        #: The last two steps' (learning rate, figures): the newest readable one feeds
        #: ``movement_keys`` without waiting on a device.
        self._recent: list[tuple[float, PendingStats]] = []
        #: Detectors that fired during this run, for the trainer-log keys.
        self._ever_fired: set[str] = set()
        #: Where the trainer's console lines go (the framework's logger); set up at start.
        self.console_logger = console_logger or log
        self.console: Console | None = None
        #: The optimizer's parameters (unsharded layouts) and the gradient of the coming step.
        self._grad_params: list[torch.Tensor] | None = None
        self._grad: torch.Tensor | float | None = None
        self._frozen: trainable.FrozenWatch | None = None
        #: The client whose run end was last submitted, by the loop's end or by the sender
        #: finding the loop gone, whichever came first (the other then adds nothing).
        self._ended: StreamClient | None = None
        self._end_lock = threading.Lock()

    def start(
        self,
        model: Any,
        optimizer: Any,
        *,
        rank: int,
        world_size: int,
        output_dir: str,
        trainer: str,
        config: dict[str, float] | None = None,
        config_text: dict[str, str] | None = None,
        preflight: PreflightFacts | None = None,
        requested_wrapper: str = "",
        stop_token: StopTokenFacts | None = None,
        heads: HeadFacts | None = None,
        resume: ResumeFacts | None = None,
        dataset_rows: tuple[int, int] | None = None,
        outermost: bool = False,
    ) -> None:
        """Measure the layout and membership, register the run and wait briefly for the sidecar.

        ``outermost``: model is the object that runs, not a module inside a wrapper the
        driver cannot see (see ``layout.recognise``)."""
        previous = self.client
        if previous is not None and previous.running:  # its loop raised: a new train() call
            self.end(previous.last_step, FAILED)
        run_id = str(self.run_id)
        self.layout = layouts.recognise(model, optimizer, outermost=outermost)
        self.membership = membership.measure(model, optimizer, self.layout)
        if self.layout.membership == layouts.UNKNOWN:
            log.warning("deadweight: the %s optimizer partitions parameters in a way this "
                        "client cannot map; optimizer membership is reported as unknown",
                        type(layouts.inner_optimizer(optimizer)).__qualname__)
        self.update = UpdateProbe(self.membership.watched, self.membership.groups,
                                  lengths=self.membership.watched_lengths)
        numbers, texts = trainable.start_facts(model, optimizer, self.layout,
                                               self.expected_trainable_pct, self.frozen_modules)
        config = {**(config or {}), **numbers, **optimizer_setup.numbers(optimizer)}
        config_text = {"optimizer": type(layouts.inner_optimizer(optimizer)).__name__,
                       **(config_text or {}), **texts}
        if not self.layout.sharded and self.layout.membership == layouts.IDENTITY:
            self._grad_params = [p for group in getattr(layouts.inner_optimizer(optimizer),
                                                        "param_groups", None) or []
                                 for p in group.get("params", [])]
        self._frozen = trainable.FrozenWatch.build(model, self.frozen_modules, self.layout)
        record = RunStartRecord(
            trainer=trainer,
            world_size=world_size,
            output_dir=str(Path(output_dir).resolve()) if output_dir else "",
            config=config,
            config_text=config_text,
            versions=preflight_versions(),
            membership=self.membership,
            preflight=preflight or PreflightFacts(),
            initial_adapter=digest.digest_adapter(model),
            host=socket.gethostname(),
            sharded=self.layout.sharded,
            wrapper=self.layout.wrapper,
            requested_wrapper=requested_wrapper,
            stop_token=stop_token,
            heads=heads,
            resume=resume,
            dataset_rows=dataset_rows,
            baseline=self.baseline,
        )
        self.client = StreamClient(self.address, run_id, rank, to_event, token=self.token,
                                   settings=self.settings, tls_ca=self.tls_ca)
        self.console = Console(self.console_logger, run_id, self.address, speaks=rank == 0)
        loop = enclosing_loop()
        if loop is not None:
            client = self.client
            watch = LoopWatch(loop, lambda: client.submitted)
            client.loop_left = functools.partial(self._loop_left, client, watch)
        self.client.start(record)
        if world_size > 1:
            # On the model as given: a wrapper's forward hooks run before its own collectives
            # (DDP's buffer broadcast), so a rank waiting there has already begun the step.
            self.progress = StepProgress(self.client, model)
            if not self.layout.sharded:
                self.replicas = ReplicaSampler(self.membership.watched_names,
                                               self.membership.watched)
        wait = self.start_timeout_seconds if may_be_listening(self.address) else 0.0
        connected = self.client.wait_connected(wait)
        if connected:
            self.client.wait_registered(self.start_timeout_seconds)
        elif self.require_sidecar:
            self.client.close(timeout=0.0)
            raise SidecarRequired(
                f"deadweight: no sidecar answered at {self.address} within "
                f"{self.start_timeout_seconds}s and require_sidecar=True"
            )
        elif not self.client.connects:
            self.client.unreachable_told = True  # said now, on the console, not at train end
        self.console.report_command = self.client.report_command
        self.console.begin(connected, wait)

    def began(self, step: int) -> None:
        """The loop began optimizer step ``step`` (a driver's step-begin hook)."""
        if self.progress is not None and self.client is not None:
            self.client.began_step = max(self.client.began_step, step)

    def evaluated(self) -> None:
        """The loop finished one evaluation batch (a driver's prediction-step hook)."""
        if self.client is not None:
            self.client.evaluated_batches += 1

    def before_step(self, learning_rate: float) -> None:
        """Snapshot the watched tensors (at the optimizer's pre-step)."""
        if self.update is None:
            return
        self._lr = learning_rate
        self._grad = None
        if self._grad_params is not None:
            try:  # a gradient we cannot sum is a figure left out, never a failure
                self._grad = trainable.grad_sq_sum(self._grad_params)
            except (RuntimeError, TypeError, ValueError):
                self._grad_params = None
        self.update.before_step()

    def after_step(self, step: int, optimizer_step_skipped: bool | DeferredScalar = False,
                   adalora_rank_pattern_set: bool | None = None) -> None:
        """Measure and report the update of the step that just ran."""
        if self.update is None or self.client is None or self.membership is None:
            return
        local_seconds, step_seconds = (self.progress.step_done(step) if self.progress is not None
                                       else (None, None))
        stats = self.update.after_step_deferred()  # read later, by the sender thread
        if stats is None:
            return
        self._recent = [*self._recent[-1:], (self._lr, stats)]
        tensors, params = membership.grads_outside_optimizer(self.membership.outside_optimizer)
        self.client.last_step = step
        self.client.submit(
            EventKind.STEP,
            StepRecord(
                step=step,
                learning_rate=self._lr,
                stats=stats,
                optimizer_params=self.membership.optimizer_params,
                grad_not_in_optimizer_tensors=tensors,
                grad_not_in_optimizer_params=params,
                optimizer_step_skipped=optimizer_step_skipped,
                adalora_rank_pattern_set=adalora_rank_pattern_set,
                grad_sq_sum=self._grad,
                declared_frozen=(len(self._frozen.tensors), self._frozen.moved())
                if self._frozen is not None else None,
                local_seconds=local_seconds,
                step_seconds=step_seconds,
            ),
        )
        if self.replicas is not None and replica_due(step):
            sample = self.replicas.sample(step)
            if sample is not None:
                self.client.submit(EventKind.REPLICA, sample)

    def tls_root(self) -> bytes | None:
        """The CA the stream client trusts for a TCP sidecar (None on a unix socket)."""
        return self.client.tls_root if self.client is not None else None

    def logger_keys(self) -> dict[str, float]:
        """The ``deadweight/*`` keys for the trainer's own loggers (see ``trainer_logs``):
        the newest step whose figures can be read without a device wait, and the verdicts
        of the sidecar's latest answer."""
        keys: dict[str, float] = {}
        for lr, pending in reversed(self._recent):
            stats = pending.peek()
            if stats is not None and self.membership is not None:
                keys.update(trainer_logs.step_keys(
                    stats.update_sq_sum, lr,
                    self.membership.optimizer_params or stats.watched_params,
                    stats.unchanged_tensors, stats.watched_tensors))
                break
        if self.client is not None:
            keys.update(trainer_logs.verdict_keys(self.client.firing, self._ever_fired,
                                                  monitored=self.client.connected))
        return keys

    def log(self, step: int, values: dict[str, Any]) -> None:
        if self.client is not None and values:
            self.client.submit(EventKind.LOG, numeric_logs(values, step))

    def checkpoint(self, step: int, path: str | os.PathLike[str], model: Any) -> None:
        if self.client is not None:
            share_with_group(path)  # a sidecar of its own uid reads it through the group
            self.client.submit_now(EventKind.CHECKPOINT, CheckpointRecord(
                step, str(Path(path).resolve()), digest.digest_adapter(model)))

    def end(self, step: int, reason: str, timeout: float = 2.0) -> None:
        """Report the run end and flush what is queued within timeout.

        The client stays readable afterwards (its counters tell what was sent and dropped).
        """
        self._release_update()
        client = self.client
        if client is not None and not self._claim_end(client):
            client.close(timeout=timeout)  # the sender ended the run already (loop_left)
        elif client is not None:
            live_firing = client.firing  # run verdicts resolve once the sidecar has the end
            client.submit_now(EventKind.RUN_END, RunEndRecord(step, reason))
            client.close(timeout=timeout)
            self._tell()
            if self.console is not None:
                self.console.end(step, reason, (*live_firing, *client.firing))

    def _claim_end(self, client: StreamClient) -> bool:
        """Whether the caller is the first to end client's run."""
        with self._end_lock:
            if client is self._ended:
                return False
            self._ended = client
            return True

    def _loop_left(self, client: StreamClient, watch: LoopWatch) -> bool:
        """On the sender thread, at a heartbeat: once the Trainer's loop is gone without
        ending the run (it raised), end the run as failed and say so on the console."""
        if not watch.left() or not self._claim_end(client):
            return False
        step = client.last_step
        client.submit_now(EventKind.RUN_END, RunEndRecord(step, FAILED))
        if self.console is not None and self.client is client:
            self.console.end(step, FAILED, client.firing)
        return True

    def _release_update(self) -> None:
        progress, self.progress = self.progress, None
        if progress is not None:
            progress.close()
        self.replicas = None
        update, self.update = self.update, None
        if update is not None:
            update.close()

    def directives(self) -> list[pb.Directive]:
        """The sidecar's new directives, once the verdicts it sent are on the console."""
        if self.client is None:
            return []
        self._tell()
        return self.client.take_directives()

    def _tell(self) -> None:
        """Print the verdicts the sidecar sent since the last look (training thread)."""
        client, console = self.client, self.console
        if client is None or console is None:
            return
        if client.report_command is not None:
            console.report_command = client.report_command
        notices = client.take_notices()
        if notices:
            console.notices(notices)
        if not console.monitored and client.connects:
            console.reconnected()

    def stopped(self, directive: pb.Directive, how: str) -> str:
        """Say a STOP on the console, naming the root cause; returns the mark a script reads."""
        firing = self.client.firing if self.client is not None else ()
        if self.console is None:
            return f"{directive.detector}: {directive.reason}"
        return self.console.stopped(directive, firing, how)

    def aborted(self, directive: pb.Directive) -> str:
        """Say an ABORT on the console as a STOP is said; returns the mark."""
        firing = self.client.firing if self.client is not None else ()
        if self.console is None:
            return f"{directive.detector}: {directive.reason}"
        return self.console.aborted(directive, firing)

    def shut_off(self) -> None:
        """Stop measuring and sending at once (after a failure of ours)."""
        self._release_update()
        client, self.client = self.client, None
        if client is not None:
            client.close(timeout=0.0)

