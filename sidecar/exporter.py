"""``/metrics``: the registry's runs and verdicts as Prometheus metrics in base units.

A custom collector builds every family from one consistent copy of the registry at scrape
time, so an expired run simply disappears and cardinality stays bounded by the registry's
caps. Labels: ``run_id`` and ``trainer`` on every run metric, ``rank`` on per-rank ones,
``detector``/``severity`` on verdicts; never a tensor name.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from deadweight import __version__
from deadweight.sidecar.actions import Actions
from deadweight.sidecar.detectors.base import Detector
from deadweight.sidecar.limits import digest_label
from deadweight.sidecar.metrics_http import TextFamily, sample_line
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.state import RunState

FIRING = "deadweight_detector_firing"
FIRING_HELP = "1 while the detector's verdict on the run stands."
#: Cached firing blocks (a run and set of firing detectors each); cleared past it.
MAX_FIRING_BLOCKS = 10_000

RUN = ["run_id", "trainer"]
RANK = [*RUN, "rank"]

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
}


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _add(family: Metric, labels: dict[str, str], value: float) -> None:
    """``family.add_metric`` for a label dict built once per run or rank and shared, read
    only, by the samples of every family (add_metric zips a new dict for each sample, and a
    scrape with 50 runs adds 2,000 of them)."""
    name = family.name + "_total" if family.type == "counter" else family.name
    family.samples.append(Sample(name, labels, value))


class DeadweightCollector(Collector):
    """Collects every deadweight_* family from the registry and the actions journal."""

    def __init__(
        self, registry: Registry, actions: Actions | None, detectors: tuple[Detector, ...]
    ) -> None:
        self.registry = registry
        self.actions = actions
        self.detectors = detectors
        #: (detector, severity) label values, read once: every run has a sample per detector.
        self._detector_labels = [(d.id, d.severity.value) for d in detectors]
        self._firing_blocks: dict[tuple[str, str, frozenset[str]], str] = {}

    def collect(self) -> Iterator[Metric]:
        """Every family, built under the registry's lock: a run stepping meanwhile (its dicts
        and deques growing) can never make a scrape fail or mix two moments."""
        return self._collect(text=False)

    def exposition(self) -> Iterator[Metric]:
        """``collect`` for the /metrics renderer: the detector-firing family (a sample per run
        and detector, nearly all 0: three quarters of the page) comes as text, a cached block
        per run and set of firing detectors, instead of as samples."""
        return self._collect(text=True)

    def _collect(self, text: bool) -> Iterator[Metric]:
        info = _gauge("deadweight_sidecar_info", "The sidecar's version.", ["version"])
        info.add_metric([__version__], 1.0)
        with self.registry.lock:
            families = [info, *self._run_metrics(text), *self._action_metrics(),
                        *self._guard_metrics()]
        yield from families

    def _guard_metrics(self) -> Iterator[Metric]:
        """Counters of what the sidecar refused or could not do (attacks and accidents)."""
        writes = CounterMetricFamily(
            "deadweight_state_write_failures",
            "Writes to the state database that failed (disk full, I/O error); the actions "
            "they carried stay pending and are retried.")
        store = self.actions.store if self.actions is not None else None
        writes.add_metric([], float(store.write_failures if store is not None else 0))
        yield writes
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

    def _firing_block(self, run_id: str, trainer: str, firing: frozenset[str]) -> str:
        """A run's deadweight_detector_firing lines (cached: they change with a verdict)."""
        key = (run_id, trainer, firing)
        block = self._firing_blocks.get(key)
        if block is None:
            if len(self._firing_blocks) >= MAX_FIRING_BLOCKS:
                self._firing_blocks.clear()
            block = self._firing_blocks[key] = "".join([
                sample_line(FIRING, {"run_id": run_id, "trainer": trainer, "detector": detector,
                                     "severity": severity}, 1.0 if detector in firing else 0.0)
                for detector, severity in self._detector_labels])
        return block

    def _run_metrics(self, text: bool) -> Iterator[Metric]:
        firing = _gauge(FIRING, FIRING_HELP, [*RUN, "detector", "severity"])
        blocks: list[str] = []
        active = _gauge("deadweight_run_active", "1 while the run has not ended.", RUN)
        step = _gauge("deadweight_step", "Latest optimizer step reported by the rank.", RANK)
        last = _gauge("deadweight_last_step_timestamp_seconds",
                      "Unix time of the rank's latest optimizer step report.", RANK)
        update_norm = _gauge("deadweight_update_norm",
                             "L2 norm of the latest optimizer step's weight update.", RUN)
        update_ratio = _gauge("deadweight_update_ratio",
                              "Scale-free update: L2 / (lr * sqrt(trainable params)).", RUN)
        frozen = _gauge("deadweight_frozen_steps",
                        "Consecutive optimizer steps (lr > 0) that moved no weight.", RUN)
        opt = _gauge("deadweight_optimizer_params",
                     "Parameters (elements) the optimizer holds.", RANK)
        trainable = _gauge("deadweight_trainable_params",
                           "Parameters (elements) with requires_grad at train begin.", RANK)
        outside = _gauge("deadweight_grad_not_in_optimizer_params",
                         "Parameters (elements) with a gradient that the optimizer lacks.", RANK)
        dropped = CounterMetricFamily("deadweight_client_dropped_events",
                                      "Events the rank's callback dropped (queue full).",
                                      labels=RANK)
        ckpts = CounterMetricFamily("deadweight_checkpoints", "Checkpoints the run saved.",
                                    labels=RUN)
        unchanged = CounterMetricFamily(
            "deadweight_checkpoint_unchanged",
            "Checkpoints byte-identical to the previous one or the initial adapter.",
            labels=RUN)
        ckpt_bytes = _gauge("deadweight_checkpoint_adapter_bytes",
                            "Size of the latest checkpoint's adapter tensors.", RUN)
        ckpt_info = _gauge("deadweight_checkpoint_info",
                           "Digest of the latest checkpoint's adapter (value 1).",
                           [*RUN, "digest"])
        logs = {name: _gauge(name, doc, RUN) for name, (_, doc) in LOG_GAUGES.items()}
        for run, findings in self.registry.runs():
            run_id, trainer = run.run_id, run.trainer
            labels = {"run_id": run_id, "trainer": trainer}
            by_id = {f.detector: f for f in findings}
            if text:
                blocks.append(self._firing_block(run_id, trainer, frozenset(
                    detector for detector, f in by_id.items() if f.firing)))
            else:
                for detector, severity in self._detector_labels:
                    f = by_id.get(detector)
                    _add(firing, {"run_id": run_id, "trainer": trainer, "detector": detector,
                                  "severity": severity},
                         1.0 if f is not None and f.firing else 0.0)
            _add(active, labels, 0.0 if run.ended else 1.0)
            for rank in run.ranks.values():
                rl = {"run_id": run_id, "trainer": trainer, "rank": str(rank.rank)}
                _add(step, rl, float(rank.step))
                if rank.last_step_time:
                    _add(last, rl, rank.last_step_time)
                _add(opt, rl, float(rank.membership.optimizer_params))
                _add(trainable, rl, float(rank.membership.trainable_params))
                latest = rank.steps[-1] if rank.steps else None
                _add(outside, rl, float(latest.grad_not_in_optimizer_params if latest else 0))
                _add(dropped, rl, float(rank.dropped_events))
            self._add_update(run, labels, update_norm, update_ratio, frozen)
            for name, (key, _) in LOG_GAUGES.items():
                value = run.log_value(key)
                if value is not None:
                    _add(logs[name], labels, value)
            _add(ckpts, labels, float(run.checkpoints_total))
            _add(unchanged, labels, float(run.checkpoints_unchanged))
            if run.checkpoints:
                latest_ckpt = run.checkpoints[-1]
                _add(ckpt_bytes, labels, float(latest_ckpt.adapter_bytes))
                _add(ckpt_info, {**labels, "digest": digest_label(latest_ckpt.combined_digest)},
                     1.0)
        yield TextFamily(FIRING, FIRING_HELP, "gauge", "".join(blocks)) if text else firing
        yield from (active, step, last, update_norm, update_ratio, frozen, opt,
                    trainable, outside, dropped, ckpts, unchanged, ckpt_bytes, ckpt_info)
        yield from logs.values()

    def _add_update(
        self,
        run: RunState,
        labels: dict[str, str],
        update_norm: GaugeMetricFamily,
        update_ratio: GaugeMetricFamily,
        frozen: GaugeMetricFamily,
    ) -> None:
        latest = run.newest_combined_step()
        if latest is None:
            return
        _add(update_norm, labels, latest.update_norm)
        ratio = latest.update_ratio
        _add(update_ratio, labels, math.nan if ratio is None else ratio)
        _add(frozen, labels, float(self.registry.frozen_streak(run)))

    def _action_metrics(self) -> Iterator[Metric]:
        actions = CounterMetricFamily(
            "deadweight_actions", "Actions taken on verdicts, by outcome.",
            labels=[*RUN, "detector", "action", "result"])
        if self.actions is not None:
            live = {run.run_id for run, _ in self.registry.runs()}  # expired runs leave too
            for key, count in sorted(self.actions.counts.items(), key=lambda kv: str(kv[0])):
                if key.run_id not in live:
                    continue
                actions.add_metric(
                    [key.run_id, key.trainer, key.detector, key.action, key.result], count)
        yield actions
