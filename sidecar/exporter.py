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

from deadweight import __version__
from deadweight.sidecar.actions import Actions
from deadweight.sidecar.detectors.base import Detector
from deadweight.sidecar.limits import digest_label
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.state import RunState

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


class DeadweightCollector(Collector):
    """Collects every deadweight_* family from the registry and the actions journal."""

    def __init__(
        self, registry: Registry, actions: Actions | None, detectors: tuple[Detector, ...]
    ) -> None:
        self.registry = registry
        self.actions = actions
        self.detectors = detectors

    def collect(self) -> Iterator[Metric]:
        """Every family, built under the registry's lock: a run stepping meanwhile (its dicts
        and deques growing) can never make a scrape fail or mix two moments."""
        info = _gauge("deadweight_sidecar_info", "The sidecar's version.", ["version"])
        info.add_metric([__version__], 1.0)
        with self.registry.lock:
            families = [info, *self._run_metrics(), *self._action_metrics(),
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

    def _run_metrics(self) -> Iterator[Metric]:
        firing = _gauge("deadweight_detector_firing",
                        "1 while the detector's verdict on the run stands.",
                        [*RUN, "detector", "severity"])
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
            labels = [run.run_id, run.trainer]
            by_id = {f.detector: f for f in findings}
            for detector in self.detectors:
                f = by_id.get(detector.id)
                firing.add_metric([*labels, detector.id, detector.severity.value],
                                  1.0 if f is not None and f.firing else 0.0)
            active.add_metric(labels, 0.0 if run.ended else 1.0)
            for rank in run.ranks.values():
                rl = [*labels, str(rank.rank)]
                step.add_metric(rl, float(rank.step))
                if rank.last_step_time:
                    last.add_metric(rl, rank.last_step_time)
                opt.add_metric(rl, float(rank.membership.optimizer_params))
                trainable.add_metric(rl, float(rank.membership.trainable_params))
                latest = rank.steps[-1] if rank.steps else None
                outside.add_metric(rl, float(latest.grad_not_in_optimizer_params
                                             if latest else 0))
                dropped.add_metric(rl, float(rank.dropped_events))
            self._add_update(run, labels, update_norm, update_ratio, frozen)
            for name, (key, _) in LOG_GAUGES.items():
                value = run.log_value(key)
                if value is not None:
                    logs[name].add_metric(labels, value)
            ckpts.add_metric(labels, float(run.checkpoints_total))
            unchanged.add_metric(labels, float(run.checkpoints_unchanged))
            if run.checkpoints:
                latest_ckpt = run.checkpoints[-1]
                ckpt_bytes.add_metric(labels, float(latest_ckpt.adapter_bytes))
                ckpt_info.add_metric([*labels, digest_label(latest_ckpt.combined_digest)], 1.0)
        yield from (firing, active, step, last, update_norm, update_ratio, frozen, opt,
                    trainable, outside, dropped, ckpts, unchanged, ckpt_bytes, ckpt_info)
        yield from logs.values()

    def _add_update(
        self,
        run: RunState,
        labels: list[str],
        update_norm: GaugeMetricFamily,
        update_ratio: GaugeMetricFamily,
        frozen: GaugeMetricFamily,
    ) -> None:
        combined = run.combined_steps()
        if not combined:
            return
        latest = combined[-1]
        update_norm.add_metric(labels, latest.update_norm)
        ratio = latest.update_ratio
        update_ratio.add_metric(labels, math.nan if ratio is None else ratio)
        frozen.add_metric(labels, float(self.registry.frozen_streak(run)))

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
