"""What deadweight tells the person at the trainer's console, through the framework's logging.

One line at train begin: the run id, the sidecar it reports to and how to open its report, or
at once that no sidecar answers and the run is NOT monitored. One line per incident of each
verdict, whatever the policy: severity, the cause, the fix and the runbook link, in the words
the sidecar sent (``VerdictNotice``); deduplicated per incident and capped per run. A STOP or
an ABORT names the root cause, not just the detector that triggered it, with its fix; under a
``kill`` policy the STOP also says the process is terminated if training goes on. At train
end a short summary, root causes first.

Lines go out at WARNING (ERROR for critical verdicts) on deadweight's own logger
(``deadweight.console``, its own stderr handler, ``console_logger``): the framework's verbosity
(``transformers.logging.set_verbosity_error()``, which many training scripts call) never hides
them, and a verdict is never lost behind the INFO lines the framework keeps quiet. Progress bars
on the terminal are cleared around each line and redrawn after it, so a line never ends up
glued to the end of a bar.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO

from ..proto import pb

#: Verdict lines printed per run at most; past it, one line says how many more the report has.
MAX_VERDICT_LINES = 20

_LEVELS = {"critical": logging.ERROR}

#: The console logger's name: ``logging.getLogger(CONSOLE_LOGGER).setLevel(...)`` tunes it.
CONSOLE_LOGGER = "deadweight.console"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a line goes out (a script or a test may have
    replaced it since the logger was made)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        """The stream is always the current stderr."""


def console_logger() -> logging.Logger:
    """deadweight's console logger, with its own stderr handler and level (WARNING), apart
    from any framework's: lines do not propagate (one line each, not one per handler up the
    tree), and a level set on it by hand is kept."""
    logger = logging.getLogger(CONSOLE_LOGGER)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
    return logger


@contextmanager
def _bars_aside() -> Iterator[None]:
    """Clear the live progress bars (tqdm, the Trainer's) while a line is written."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        yield
        return
    if not getattr(tqdm, "_instances", None):
        yield
        return
    with tqdm.external_write_mode():
        yield


def report_hint(run_id: str, command: str | None = None) -> str:
    """How to open the run's report: the sidecar's own command (with its state dir) once it
    said it; a memory-only sidecar keeps no report, so the hint points at status instead."""
    if command is None:
        return f"deadweight report {run_id} --state-dir <the sidecar's state dir>"
    if not command:
        return ("none kept (the sidecar has no --state-dir); while it runs: deadweight status "
                "--json")
    return command


def verdict_line(notice: pb.VerdictNotice) -> str:
    """One verdict: severity, detector and step, cause, fix, runbook link."""
    evidence = f" ({notice.evidence})" if notice.evidence else ""
    parts = [f"deadweight {notice.severity.upper()} {notice.detector} (step {notice.step}): "
             f"{notice.cause.rstrip('.')}{evidence}."]
    if notice.fix:
        parts.append(f"Fix: {notice.fix.rstrip('.')}.")
    if notice.runbook_url:
        parts.append(f"Runbook: {notice.runbook_url}")
    return " ".join(parts)


#: The detector id a STOP from on-call carries (``deadweight stop``).
OPERATOR = "operator"

class Console:
    """The console lines of one run on one rank (only rank 0 prints verdicts)."""

    def __init__(self, logger: logging.Logger, run_id: str, address: str, *,
                 speaks: bool = True, max_lines: int = MAX_VERDICT_LINES) -> None:
        self.logger = logger
        self.run_id = run_id
        self.address = address
        self.speaks = speaks
        self.max_lines = max_lines
        #: Every incident told, by (detector, incident number), in arrival order.
        self.verdicts: dict[tuple[str, int], pb.VerdictNotice] = {}
        self.printed = 0
        self.held = 0
        self.monitored = False
        #: The root cause and the reason when a STOP from the sidecar ended training.
        self.stopped_by: str | None = None
        #: The root cause's detector id, when a STOP came.
        self.stop_root: str | None = None
        #: The root cause and the reason when an ABORT from the sidecar ended training, and
        #: the root cause's detector id.
        self.aborted_by: str | None = None
        self.abort_root: str | None = None
        #: The sidecar's command for the run's report (``StreamClient.report_command``).
        self.report_command: str | None = None

    def report(self) -> str:
        return report_hint(self.run_id, self.report_command)

    def _emit(self, level: int, message: str, *args: object) -> None:
        if not self.logger.isEnabledFor(level):
            return
        with _bars_aside():
            self.logger.log(level, message, *args)

    # -- train begin -----------------------------------------------------------------------

    def begin(self, monitored: bool, waited: float) -> None:
        """The one train-begin line (every rank says when it is not monitored)."""
        self.monitored = monitored
        if monitored:
            if self.speaks and self.report_command == "":
                self._emit(logging.WARNING, "deadweight: run %s reports to the sidecar at %s, "
                           "which keeps no state dir (--state-dir): no report of the run will "
                           "outlive it; while it runs: deadweight status", self.run_id,
                           self.address)
            elif self.speaks:
                self._emit(logging.WARNING, "deadweight: run %s reports to the sidecar at %s; "
                           "open its report with: %s", self.run_id, self.address,
                           self.report())
            return
        why = ("no sidecar socket at that path" if waited == 0.0
               else f"no answer within {waited:g}s")
        self._emit(logging.WARNING, "deadweight: no sidecar answers at %s (%s): run %s is NOT "
                   "monitored; no verdict will be given unless a sidecar comes up while it "
                   "trains", self.address, why, self.run_id)

    def reconnected(self) -> None:
        """A sidecar answered after the begin line said none did (the stream client says so
        on the console): the run is judged from then on."""
        self.monitored = True

    # -- verdicts ----------------------------------------------------------------------------

    def notices(self, notices: Iterable[pb.VerdictNotice]) -> None:
        """Print each incident not printed yet, up to the cap."""
        for notice in notices:
            key = (notice.detector, int(notice.incident))
            if key in self.verdicts:
                continue
            self.verdicts[key] = notice
            if not self.speaks:
                continue
            if self.printed < self.max_lines:
                self.printed += 1
                self._emit(_LEVELS.get(notice.severity, logging.WARNING), "%s",
                           verdict_line(notice))
            else:
                self.held += 1

    def ordered(self) -> list[pb.VerdictNotice]:
        """The latest incident of each detector, root causes first, information last."""
        latest: dict[str, pb.VerdictNotice] = {}
        for notice in self.verdicts.values():
            latest[notice.detector] = notice
        return sorted(latest.values(), key=lambda n: (n.severity == "info", n.cause_rank))

    def root_cause(self, trigger: str, firing: Iterable[str]) -> str:
        """The first cause among the verdicts firing now and the trigger (information, such
        as ``no_kl_anchor`` on a GRPO run with beta 0, is never named the root cause of a
        STOP that a verdict of something wrong triggered)."""
        candidates = {n.detector: (n.severity == "info", n.cause_rank) for n in self.ordered()
                      if n.detector in set(firing) | {trigger}}
        if not candidates:
            return trigger
        return min(candidates, key=lambda d: (*candidates[d], d != trigger))

    def stopped(self, directive: pb.Directive, firing: Iterable[str], how: str) -> str:
        """The STOP line, once: the root cause first, then the trigger; returns the mark.

        Under the trigger's ``kill`` policy it also says that the sidecar terminates the
        process if training goes on (the escalation that follows a STOP not obeyed)."""
        if self.stopped_by is not None:
            return self.stopped_by
        mark, root, notice = self._cause(directive, firing, "stop")
        self.stopped_by, self.stop_root = mark, root
        trigger = self._notice(directive.detector)
        kill = (" Policy kill: unless training ends within the sidecar's stop grace, this "
                "process is about to be terminated (SIGTERM, then SIGKILL)."
                if trigger is not None and trigger.policy == "kill" else "")
        self._halt("STOPPED", how, mark, notice, kill)
        return mark

    def aborted(self, directive: pb.Directive, firing: Iterable[str]) -> str:
        """The ABORT line, once, in the STOP's words: the root cause first, then the trigger,
        and that the process is about to be terminated; returns the mark."""
        if self.aborted_by is not None:
            return self.aborted_by
        mark, root, notice = self._cause(directive, firing, "abort")
        self.aborted_by, self.abort_root = mark, root
        self._halt("ABORTED", "DeadweightAbort is raised into the training loop: the process "
                   "is about to be terminated", mark, notice, "")
        return mark

    def _notice(self, detector: str) -> pb.VerdictNotice | None:
        return next((n for n in self.ordered() if n.detector == detector), None)

    def _cause(self, directive: pb.Directive, firing: Iterable[str], act: str
               ) -> tuple[str, str, pb.VerdictNotice | None]:
        """(the mark, the root cause's id, its notice): "root: cause (act triggered by X)"."""
        root = self.root_cause(directive.detector, firing)
        notice = self._notice(root)
        mark = f"{root}: {notice.cause.rstrip('.')}" if notice is not None else (
            f"{root}: {directive.reason}")
        if root != directive.detector:
            # a person's STOP says who and why (deadweight stop --reason); a verdict's, which
            trigger = (f"{directive.detector}: {directive.reason}"
                       if directive.detector == OPERATOR else directive.detector)
            mark += f" ({act} triggered by {trigger})"
        return mark, root, notice

    def _halt(self, word: str, how: str, mark: str, notice: pb.VerdictNotice | None,
              after: str) -> None:
        """One line for a directive that ends training (rank 0 says it for the run)."""
        if not self.speaks:
            return
        fix = f" Fix: {notice.fix.rstrip('.')}." if notice is not None and notice.fix else ""
        self._emit(logging.ERROR, "deadweight %s run %s (%s), root cause %s.%s%s Report: %s",
                   word, self.run_id, how, mark, fix, after, self.report())

    # -- train end ---------------------------------------------------------------------------

    def end(self, step: int, reason: str, firing: Iterable[str]) -> None:
        """The summary line: every verdict of the run, root causes first."""
        if not self.speaks:
            return
        if not self.monitored:
            self._emit(logging.WARNING, "deadweight: run %s ended (%s) at step %d NOT "
                       "monitored: no verdict was given on it", self.run_id, reason, step)
            return
        verdicts = self.ordered()
        if self.held:
            self._emit(logging.WARNING, "deadweight: %d more verdict lines were not printed "
                       "(at most %d a run)", self.held, self.max_lines)
        if not verdicts:
            self._emit(logging.WARNING, "deadweight: run %s ended (%s) at step %d; no verdict; "
                       "report: %s", self.run_id, reason, step, self.report())
            return
        now = set(firing)
        listed = ", ".join(
            f"{n.detector} ({n.severity}, step {n.step}"
            f"{', firing at end' if n.detector in now else ''})" for n in verdicts)
        stopped = f"; STOPPED by deadweight, root cause {self.stop_root}" if (
            self.stop_root) else ""
        if self.abort_root:
            stopped += f"; ABORTED by deadweight, root cause {self.abort_root}"
        self._emit(logging.ERROR, "deadweight: run %s ended (%s) at step %d with %d "
                   "verdict(s), root cause first: %s%s; report: %s", self.run_id, reason, step,
                   len(verdicts), listed, stopped, self.report())
