"""``/metrics``: the registry's runs and verdicts as Prometheus metrics in base units.

A custom collector builds every family from one consistent copy of the registry at scrape
time, so an expired run simply disappears and cardinality stays bounded by the registry's
caps. Labels: ``run_id`` and ``trainer`` on every run metric, ``rank`` on per-rank ones,
``detector``/``severity`` on verdicts; never a tensor name.

Under the registry's lock only the figures are copied (``RunFigures``, plain values); the
families are written from that copy after the lock is released, so ingest never waits on a
scrape's formatting. The same copy feeds both outputs: ``collect`` (the client library's
families) and ``exposition`` (the /metrics page, written as text with each run's label text
spelled once and kept), so the two cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from ... import __version__
from ..actions.pager_health import TargetHealth
from ..actions.policy import Actions
from ..detectors.base import Detector
from ..ingest.attestation import AttestationServer
from ..ingest.auth_failures import THROTTLED, WRONG_TOKEN, AuthFailures
from ..model.finding import Finding
from ..model.limits import digest_label
from ..model.run_state import RunState
from ..registry import Registry
from .http import TextFamily, number, sample_line, sample_prefix

FIRING = "deadweight_detector_firing"
FIRING_HELP = ("1 while the detector's verdict on the run stands (also after the run ended "
               "with it firing, until the run expires).")
#: Cached firing blocks (a run and set of firing detectors each); cleared past it.
MAX_FIRING_BLOCKS = 10_000

RUN = ["run_id", "trainer"]

#: deadweight metric name -> the trainer log key it mirrors.
LOG_GAUGES = {
    "deadweight_loss": ("loss", "Training loss as the trainer logged it."),
    "deadweight_grad_norm": ("grad_norm", "Gradient norm as the trainer logged it."),
    "deadweight_learning_rate": ("learning_rate", "Learning rate as the trainer logged it."),
    "deadweight_kl": ("kl", "KL to the reference policy as the trainer logged it."),
    "deadweight_reward": ("reward", "Mean reward as the trainer logged it."),
    "deadweight_reward_std": ("reward_std", "Reward standard deviation (whole batch)."),
    "deadweight_frac_reward_zero_std": (
        "frac_reward_zero_std", "Fraction of prompt groups whose rewards were all equal."),
    "deadweight_entropy": ("entropy", "Mean token entropy as the trainer logged it."),
    "deadweight_completion_mean_length": (
        "completions/mean_length", "Mean completion length in tokens."),
    "deadweight_sampling_logp_difference": (
        "sampling/sampling_logp_difference/mean",
        "Mean difference per token between the trainer's and the generation engine's "
        "log-probabilities of the sampled tokens (logged with a separate engine only)."),
}
_LOG_KEYS = tuple(key for key, _ in LOG_GAUGES.values())


class RunFamily(NamedTuple):
    """A per-run family: its samples carry ``run_id``, ``trainer`` and maybe one label more."""

    name: str
    documentation: str
    type: str  # "gauge" or "counter"
    extra_label: str  # "rank", "digest", "rank,phase" (values joined by ",") or "" (none)


#: The per-run families after the detector-firing one, in page order.
RUN_FAMILIES = (
    RunFamily("deadweight_run_active", "1 while the run has not ended.", "gauge", ""),
    RunFamily("deadweight_step", "Latest optimizer step reported by the rank.", "gauge", "rank"),
    RunFamily("deadweight_last_step_timestamp_seconds",
              "Unix time of the rank's latest optimizer step report.", "gauge", "rank"),
    RunFamily("deadweight_update_norm",
              "L2 norm of the latest optimizer step's weight update.", "gauge", ""),
    RunFamily("deadweight_update_ratio",
              "Scale-free update: L2 / (lr * sqrt(trainable params)).", "gauge", ""),
    RunFamily("deadweight_frozen_steps",
              "Consecutive optimizer steps (lr > 0) that moved no weight.", "gauge", ""),
    RunFamily("deadweight_optimizer_params", "Parameters (elements) the optimizer holds.",
              "gauge", "rank"),
    RunFamily("deadweight_trainable_params",
              "Parameters (elements) with requires_grad at train begin.", "gauge", "rank"),
    RunFamily("deadweight_grad_not_in_optimizer_params",
              "Parameters (elements) with a gradient that the optimizer lacks.", "gauge", "rank"),
    RunFamily("deadweight_client_dropped_events",
              "Events the rank's callback dropped (queue full).", "counter", "rank"),
    RunFamily("deadweight_checkpoints", "Checkpoints the run saved.", "counter", ""),
    RunFamily("deadweight_checkpoint_unchanged",
              "Checkpoints byte-identical to the previous one or the initial adapter.",
              "counter", ""),
    RunFamily("deadweight_checkpoint_adapter_bytes",
              "Size of the latest checkpoint's adapter tensors.", "gauge", ""),
    RunFamily("deadweight_checkpoint_info",
              "Digest of the latest checkpoint's adapter (value 1).", "gauge", "digest"),
    *(RunFamily(name, doc, "gauge", "") for name, (_, doc) in LOG_GAUGES.items()),
    RunFamily("deadweight_rank_phase_timestamp_seconds",
              "Unix time the rank last entered the phase of a step (forward, backward, "
              "backward_done, optimizer_step; the first three on runs of several ranks).",
              "gauge",
              "rank,phase"),
    RunFamily("deadweight_rank_progress_steps",
              "How far the rank got: its last optimizer step, plus .25 in the next step's "
              "forward pass, .5 in its backward, .75 after it (the gradient sync).", "gauge",
              "rank"),
)
(ACTIVE, STEP, LAST_STEP, UPDATE_NORM, UPDATE_RATIO, FROZEN, OPTIMIZER, TRAINABLE, OUTSIDE,
 DROPPED, CHECKPOINTS, UNCHANGED, CHECKPOINT_BYTES, CHECKPOINT_INFO) = range(14)
FIRST_LOG = CHECKPOINT_INFO + 1
PHASE_TIME = FIRST_LOG + len(LOG_GAUGES)
PROGRESS = PHASE_TIME + 1


class RankFigures(NamedTuple):
    """What /metrics says of one rank."""

    rank: str
    step: float
    last_step_time: float  # 0: no step yet (no sample)
    optimizer_params: float
    trainable_params: float
    grad_not_in_optimizer_params: float
    dropped_events: float
    #: (phase, Unix time) of the phases the rank reported (its optimizer steps at least),
    #: and its progress in steps.
    phase_times: tuple[tuple[str, float], ...] = ()
    progress: float | None = None


def extra_labels(family: RunFamily, extra: str) -> dict[str, str]:
    """The family's labels beyond run_id and trainer, from a sample's extra value."""
    if not family.extra_label:
        return {}
    return dict(zip(family.extra_label.split(","), extra.split(","), strict=True))


class RunFigures(NamedTuple):
    """What /metrics says of one run, copied under the registry's lock."""

    run_id: str
    trainer: str
    firing: frozenset[str]
    ended: bool
    ranks: tuple[RankFigures, ...]
    update: tuple[float, float, float] | None  # update norm, ratio (nan: unknown), frozen steps
    #: Per LOG_GAUGES; None: never logged (no sample). A logged -0.0 is exported as 0.0 (the
    #: same number), so equal figures always mean equal text.
    logs: tuple[float | None, ...]
    checkpoints: float
    unchanged: float
    checkpoint: tuple[float, str] | None  # latest checkpoint's adapter bytes and digest label
    #: (detector, severity) of the firing verdicts whose severity is not their spec's (a
    #: verdict that stepped up or fired lower: ``Verdict.severity``).
    stepped: tuple[tuple[str, str], ...] = ()


#: (family index in RUN_FAMILIES, its extra label's value or "", value).
RunSample = tuple[int, str, float]


def run_samples(figures: RunFigures) -> list[RunSample]:
    """The run's samples of every RUN_FAMILIES family, in page order within each family."""
    out: list[RunSample] = [(ACTIVE, "", 0.0 if figures.ended else 1.0)]
    for rank in figures.ranks:
        label = rank.rank
        out.append((STEP, label, rank.step))
        if rank.last_step_time:
            out.append((LAST_STEP, label, rank.last_step_time))
        out += ((OPTIMIZER, label, rank.optimizer_params),
                (TRAINABLE, label, rank.trainable_params),
                (OUTSIDE, label, rank.grad_not_in_optimizer_params),
                (DROPPED, label, rank.dropped_events))
    if figures.update is not None:
        norm, ratio, frozen = figures.update
        out += ((UPDATE_NORM, "", norm), (UPDATE_RATIO, "", ratio), (FROZEN, "", frozen))
    out += [(FIRST_LOG + i, "", value) for i, value in enumerate(figures.logs)
            if value is not None]
    for rank in figures.ranks:
        out += [(PHASE_TIME, f"{rank.rank},{phase}", at) for phase, at in rank.phase_times]
    out += [(PROGRESS, rank.rank, rank.progress) for rank in figures.ranks
            if rank.progress is not None]
    out += ((CHECKPOINTS, "", figures.checkpoints), (UNCHANGED, "", figures.unchanged))
    if figures.checkpoint is not None:
        size, digest = figures.checkpoint
        out += ((CHECKPOINT_BYTES, "", size), (CHECKPOINT_INFO, digest, 1.0))
    return out


class _RunText(NamedTuple):
    """A run's lines on the last page, and the figures they were written from."""

    figures: RunFigures
    lines: list[tuple[int, str]]  # (family index, sample line), in run_samples order
    prefixes: dict[tuple[int, str], str]  # (family index, extra label value) -> line prefix


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _sample_name(family: RunFamily) -> str:
    return family.name + "_total" if family.type == "counter" else family.name


class DeadweightCollector(Collector):
    """Collects every deadweight_* family from the registry and the actions journal."""

    def __init__(
        self, registry: Registry, actions: Actions | None, detectors: tuple[Detector, ...],
        attestation: AttestationServer | None = None,
        pagers: Iterable[TargetHealth] = (),
        auth_failures: AuthFailures | None = None,
    ) -> None:
        self.registry = registry
        #: Failed TCP authentications (None: no TCP listener counts them here).
        self.auth_failures = auth_failures
        #: The pager targets whose health is exported (``pager_health``).
        self.pagers = tuple(pagers)
        self.actions = actions
        self.detectors = detectors
        #: The ``.attest`` listener, whose refused connections are exported (None: no socket).
        self.attestation = attestation
        #: (detector, severity) label values, read once: every run has a sample per detector.
        self._detector_labels = [(d.id, d.severity.value) for d in detectors]
        self._spec_severity = dict(self._detector_labels)
        self._firing_blocks: dict[
            tuple[str, str, frozenset[str], tuple[tuple[str, str], ...]], str] = {}
        #: run_id -> the run's lines on the last page written (see ``_run_text``).
        self._texts: dict[str, _RunText] = {}

    def collect(self) -> Iterator[Metric]:
        """Every family, from figures copied under the registry's lock: a run stepping
        meanwhile (its dicts and deques growing) can never make a scrape fail or mix two
        moments."""
        info, figures, actions, guards = self._snapshot()
        families: list[Metric] = [info, self._firing_family(figures)]
        families += self._run_families(figures)
        yield from (*families, actions, *guards)

    def exposition(self) -> Iterator[Metric]:
        """``collect`` for the /metrics renderer: the per-run families come as text
        (``TextFamily``), each run's label text written once and kept while the run lives,
        the detector-firing lines (a sample per run and detector, nearly all 0) as a cached
        block per run and set of firing detectors."""
        info, figures, actions, guards = self._snapshot()
        yield info
        yield TextFamily(FIRING, FIRING_HELP, "gauge", "".join([
            self._firing_block(f.run_id, f.trainer, f.firing, f.stepped) for f in figures]))
        yield from self._run_text(figures)
        yield actions
        yield from guards

    # -- the copy under the lock -----------------------------------------------------------

    def _snapshot(self) -> tuple[Metric, list[RunFigures], Metric, list[Metric]]:
        info = _gauge("deadweight_sidecar_info", "The sidecar's version.", ["version"])
        info.add_metric([__version__], 1.0)
        with self.registry.lock:
            runs = self.registry.runs()
            figures = [self._figures(run, findings) for run, findings in runs]
            actions = self._action_metrics({run.run_id for run, _ in runs})
            guards = list(self._guard_metrics())
        guards += self._pager_metrics()
        guards.append(self._auth_metrics())
        guards.append(self._silence_metrics())
        return info, figures, actions, guards

    def _figures(self, run: RunState, findings: list[Finding]) -> RunFigures:
        ranks = []
        for rank in run.ranks.values():
            latest = rank.steps[-1] if rank.steps else None
            membership = rank.membership
            # Phases inside a step where the client marks them (runs of several ranks);
            # every rank has its optimizer steps.
            times = {**rank.phase_times}
            times["optimizer_step"] = max(times.get("optimizer_step", 0.0), rank.last_step_time)
            phases = tuple((p, t) for p, t in sorted(times.items()) if t)
            progress = rank.position.progress_steps
            ranks.append(RankFigures(
                str(rank.rank), float(rank.step), rank.last_step_time,
                float(membership.optimizer_params), float(membership.trainable_params),
                float(latest.grad_not_in_optimizer_params if latest else 0),
                float(rank.dropped_events), phases, progress))
        newest = run.newest_combined_step()
        update = None
        if newest is not None:
            ratio = newest.update_ratio
            update = (newest.update_norm, math.nan if ratio is None else ratio,
                      float(self.registry.frozen_streak(run)))
        logs = run.logs
        checkpoint = None
        if run.checkpoints:
            latest_ckpt = run.checkpoints[-1]
            checkpoint = (float(latest_ckpt.adapter_bytes),
                          digest_label(latest_ckpt.combined_digest))
        return RunFigures(
            run.run_id, run.trainer, frozenset(f.detector for f in findings if f.firing),
            run.ended, tuple(ranks), update,
            tuple([None if (value := logs.get(key)) is None else value or 0.0
                   for key in _LOG_KEYS]),
            float(run.checkpoints_total), float(run.checkpoints_unchanged), checkpoint,
            tuple(sorted((f.detector, f.severity) for f in findings
                         if f.firing and f.severity != self._spec_severity.get(f.detector))))

    # -- the client library's families -----------------------------------------------------

    def _firing_family(self, figures: list[RunFigures]) -> Metric:
        firing = _gauge(FIRING, FIRING_HELP, [*RUN, "detector", "severity"])
        for f in figures:
            stepped = dict(f.stepped)
            for detector, severity in self._detector_labels:
                firing.samples.append(Sample(FIRING, {
                    "run_id": f.run_id, "trainer": f.trainer, "detector": detector,
                    "severity": stepped.get(detector, severity)},
                    1.0 if detector in f.firing else 0.0))
        return firing

    @staticmethod
    def _run_families(figures: list[RunFigures]) -> list[Metric]:
        families: list[Metric] = []
        for family in RUN_FAMILIES:
            labels = [*RUN, family.extra_label] if family.extra_label else RUN
            families.append(CounterMetricFamily(family.name, family.documentation,
                                                labels=labels)
                            if family.type == "counter"
                            else _gauge(family.name, family.documentation, labels))
        names = [_sample_name(family) for family in RUN_FAMILIES]
        for f in figures:
            base = {"run_id": f.run_id, "trainer": f.trainer}
            for index, extra, value in run_samples(f):
                families[index].samples.append(Sample(
                    names[index], {**base, **extra_labels(RUN_FAMILIES[index], extra)}, value))
        return families

    # -- the /metrics text -----------------------------------------------------------------

    def _firing_block(self, run_id: str, trainer: str, firing: frozenset[str],
                      stepped: tuple[tuple[str, str], ...] = ()) -> str:
        """A run's deadweight_detector_firing lines (cached: they change with a verdict); a
        verdict firing at another severity than its spec's carries that one."""
        key = (run_id, trainer, firing, stepped)
        block = self._firing_blocks.get(key)
        if block is None:
            if len(self._firing_blocks) >= MAX_FIRING_BLOCKS:
                self._firing_blocks.clear()
            severities = dict(stepped)
            block = self._firing_blocks[key] = "".join([
                sample_line(FIRING, {"run_id": run_id, "trainer": trainer, "detector": detector,
                                     "severity": severities.get(detector, severity)},
                            1.0 if detector in firing else 0.0)
                for detector, severity in self._detector_labels])
        return block

    def _run_text(self, figures: Iterable[RunFigures]) -> list[TextFamily]:
        """The RUN_FAMILIES as text. A run whose figures equal those of the last page keeps
        its lines; otherwise only the values are spelled again (its label text is kept).
        Entries of runs that left are dropped with each page."""
        lines: list[list[str]] = [[] for _ in RUN_FAMILIES]
        inf = math.inf
        kept: dict[str, _RunText] = self._texts
        written: dict[str, _RunText] = {}
        for f in figures:
            entry = kept.get(f.run_id)
            if entry is None or entry.figures != f:
                samples = run_samples(f)
                prefixes = entry.prefixes if entry is not None and \
                    entry.figures.trainer == f.trainer else {}
                if len(prefixes) > 2 * len(samples):  # old digests and ranks pile up: start over
                    prefixes = {}
                run_lines = []
                for index, extra, value in samples:
                    prefix = prefixes.get((index, extra))
                    if prefix is None:
                        family = RUN_FAMILIES[index]
                        labels = {"run_id": f.run_id, "trainer": f.trainer,
                                  **extra_labels(family, extra)}
                        prefix = prefixes[index, extra] = sample_prefix(_sample_name(family),
                                                                        labels)
                    spelled = repr(value) if -inf < value < 1e6 else number(value)
                    run_lines.append((index, f"{prefix}{spelled}\n"))
                entry = _RunText(f, run_lines, prefixes)
            written[f.run_id] = entry
            for index, line in entry.lines:
                lines[index].append(line)
        self._texts = written
        return [TextFamily(family.name, family.documentation, family.type, "".join(text))
                for family, text in zip(RUN_FAMILIES, lines, strict=True)]

    # -- sidecar-wide families -------------------------------------------------------------

    def _guard_metrics(self) -> Iterator[Metric]:
        """Counters of what the sidecar refused or could not do (attacks and accidents)."""
        writes = CounterMetricFamily(
            "deadweight_state_write_failures",
            "Writes to the state database that failed (disk full, I/O error); the actions "
            "they carried stay pending and are retried.")
        store = self.actions.store if self.actions is not None else None
        writes.add_metric([], float(store.write_failures if store is not None else 0))
        yield writes
        queue = self.registry.history_queue
        lost = CounterMetricFamily(
            "deadweight_history_rows_dropped",
            "Step and log history rows (for deadweight report) dropped before they were "
            "written: the history queue was full, its disk slower than the runs.")
        lost.add_metric([], float(queue.dropped if queue is not None else 0))
        yield lost
        refused = CounterMetricFamily(
            "deadweight_checkpoint_refused",
            "Client-named checkpoint paths not read (outside --watch-root, another uid's, "
            "over a cap, not a regular file).")
        refused.add_metric([], float(getattr(self.registry.watcher, "refused", 0)))
        yield refused
        batches = CounterMetricFamily(
            "deadweight_batches_refused",
            "Batches refused, by kind: attestation (an unattested stream on the unix socket), "
            "identity (a rank or run of another process), capacity, invalid.",
            labels=["kind"])
        for kind in ("attestation", "identity", "capacity", "invalid"):
            batches.add_metric([kind], float(self.registry.refusals[kind]))
        yield batches
        runs = CounterMetricFamily(
            "deadweight_runs_refused",
            "New runs refused for capacity, by uid (unknown: TCP; other: past 64 uids) and "
            "reason: process (--max-runs-per-process), uid (--max-runs-per-uid), table "
            "(--max-runs full and the newcomer's process holds the most live runs).",
            labels=["uid", "reason"])
        for (uid, reason), count in sorted(self.registry.capacity_refusals.items()):
            runs.add_metric([uid, reason], float(count))
        yield runs
        evicted = CounterMetricFamily(
            "deadweight_runs_evicted",
            "Live runs forgotten to let another process in: the table was full and their "
            "process held the most live runs.")
        evicted.add_metric([], float(self.registry.evicted_live_runs))
        yield evicted
        steps = CounterMetricFamily(
            "deadweight_steps_refused",
            "Step reports not applied, by reason: out_of_order (no newer than the rank's "
            "newest step, with a new sequence number), too_far (over a million steps beyond "
            "it, or a first step over 100 million), negative (below zero), outlier (applied, "
            "then dropped when the reports after it went on from below it).",
            labels=["reason"])
        for reason in ("out_of_order", "too_far", "negative", "outlier"):
            steps.add_metric([reason], float(self.registry.steps_refused[reason]))
        yield steps
        closed = CounterMetricFamily(
            "deadweight_attestation_refused_connections",
            "Connections to the attestation socket closed before any work because the "
            "peer's uid may not report (not a trainer uid).")
        closed.add_metric([], float(self.attestation.refused_uid
                                    if self.attestation is not None else 0))
        yield closed
        lives = CounterMetricFamily(
            "deadweight_run_incarnations",
            "Incarnations started by a rank rebound to another process or a run id used "
            "again (the old incarnation is closed, its verdicts kept).")
        lives.add_metric([], float(self.registry.incarnations_started))
        yield lives
        pending = CounterMetricFamily(
            "deadweight_verdicts_pending",
            "Verdict firings postponed because the journal could not be written.")
        pending.add_metric([], float(self.registry.pending_verdicts))
        yield pending
        optional = _gauge("deadweight_unattested_allowed",
                          "1 when the operator let unattested streams register runs on the "
                          "unix socket (--allow-unattested).", [])
        optional.add_metric([], 1.0 if self.registry.allow_unattested else 0.0)
        yield optional

    def _silence_metrics(self) -> Metric:
        """1 per detector silenced on a run now (``deadweight silence``): the rules leave
        it out, as the sidecar's own pages do."""
        silenced = _gauge("deadweight_detector_silenced",
                          "1 while the detector is silenced on the run by hand (it does not "
                          "page).", ["run_id", "detector"])
        if self.actions is not None:
            for silence in self.actions.silences.all():
                silenced.add_metric([silence.run_id, silence.detector], 1.0)
        return silenced

    def _auth_metrics(self) -> Metric:
        """Failed TCP authentications: wrong or missing tokens, and calls refused unread
        from a host that failed too often (``ingest.auth_failures``)."""
        failures = CounterMetricFamily(
            "deadweight_auth_failures",
            "TCP calls refused for their bearer token: wrong_token (missing or wrong), "
            "throttled (the host failed too often; its token was not compared).",
            labels=["result"])
        counts = self.auth_failures.counts if self.auth_failures is not None else {}
        for result in (WRONG_TOKEN, THROTTLED):
            failures.add_metric([result], float(counts.get(result, 0)))
        return failures

    def _pager_metrics(self) -> list[Metric]:
        """Per pager target: POSTs tried, failed, when one last got through, and the
        outbox's backlog (its size and the age of its oldest delivery)."""
        labels = ["target", "kind"]
        attempts = CounterMetricFamily(
            "deadweight_pager_attempts", "Deliveries tried to the pager target (POSTs).",
            labels=labels)
        failures = CounterMetricFamily(
            "deadweight_pager_failures",
            "Deliveries to the pager target that failed (unreachable, refused, timed out).",
            labels=labels)
        last = _gauge("deadweight_pager_last_success_timestamp_seconds",
                      "Unix time of the pager target's last successful delivery (0: never).",
                      labels)
        queued = _gauge("deadweight_pager_queued",
                        "Deliveries to the pager target not yet acknowledged (the pager "
                        "outbox retries them, also after a restart).", labels)
        oldest = _gauge("deadweight_pager_oldest_unacknowledged_age_seconds",
                        "Age of the pager target's oldest unacknowledged delivery (0: none "
                        "waits); one that only grows is a stuck queue.", labels)
        for health in self.pagers:
            tried, failed, success = health.read()
            pending, age = health.backlog()
            values = [health.target, health.kind]
            attempts.add_metric(values, float(tried))
            failures.add_metric(values, float(failed))
            last.add_metric(values, success)
            queued.add_metric(values, float(pending))
            oldest.add_metric(values, age)
        return [attempts, failures, last, queued, oldest]

    def _action_metrics(self, live: set[str]) -> Metric:
        """Actions of the live runs (an expired run's counters leave with it)."""
        actions = CounterMetricFamily(
            "deadweight_actions", "Actions taken on verdicts, by outcome.",
            labels=[*RUN, "detector", "action", "result"])
        if self.actions is not None:
            for key, count in sorted(self.actions.counts.items(), key=lambda kv: str(kv[0])):
                if key.run_id not in live:
                    continue
                actions.add_metric(
                    [key.run_id, key.trainer, key.detector, key.action, key.result], count)
        return actions
