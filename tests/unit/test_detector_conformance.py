"""Every detector of ``detectors.ALL``, one table row each: a case where it must fire and its
closest healthy twin, where no detector may fire.

This is where a new detector's first test goes: add its row to ``ROWS`` (the table must name
every detector, so a detector without a row fails ``test_every_detector_has_a_row``). Each case
is fed as wire events into a real ``Registry``, exactly as the server hands them over. The real
failures, on real trainers, are proved in ``tests/integration/test_catalogue_*``.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from deadweight.proto import pb
from deadweight.sidecar.baseline import fingerprint as prints
from deadweight.sidecar.baseline.model import BINS, Band, Baseline, ModuleFacts
from deadweight.sidecar.detectors import ALL, BY_ID
from deadweight.sidecar.detectors.spec import CONFORMANCE_TWIN, MATRIX
from deadweight.sidecar.model.inspection import CheckpointInspection
from deadweight.sidecar.model.nonces import Attestor
from deadweight.sidecar.model.process import ProcessIdentity, boot_id, start_time
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Peer, Registry
from tests.support.detector_feed import MEMBERSHIP, Feed

Play = Callable[[Feed], None]
GRPO = {"beta": 0.04, "num_generations": 2.0, "learning_rate": 1e-4, "total_steps": 20.0}
SFT = {"learning_rate": 2e-4, "total_steps": 20.0}
D0 = pb.AdapterDigest(combined="d0", tensors={"a.lora_B.weight": "t0"})
D1 = pb.AdapterDigest(combined="d1", tensors={"a.lora_B.weight": "t1"})
D2 = pb.AdapterDigest(combined="d2", tensors={"a.lora_B.weight": "t2"})


@dataclass(frozen=True)
class Case:
    """A run's start (``Feed`` keyword arguments: trainer, config, RunStart fields) and what it
    then sends."""

    play: Play
    start: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    detector: str
    fires: Case
    silent: Case
    settings: dict[str, Any] = field(default_factory=dict)
    #: The registry redeems attestation nonces (a row about which process owns a run).
    attested: bool = False


def steps(n: int, first: int = 1, grad_norm: float | None = 1.0, loss: float = 2.0,
          **step: Any) -> Play:
    """n optimizer steps, each followed by the Trainer's log of that step."""
    def play(feed: Feed) -> None:
        for s in range(first, first + n):
            feed.step(s, **step)
            values = {"loss": loss} | ({} if grad_norm is None else {"grad_norm": grad_norm})
            feed.log(s, **values)
    return play


def logs(*series: dict[str, float], first: int = 1) -> Play:
    """One log report per mapping, at steps first, first + 1, ..."""
    def play(feed: Feed) -> None:
        for s, values in enumerate(series, start=first):
            feed.log(s, **values)
    return play


def stepped(*series: dict[str, float]) -> Play:
    """An optimizer step, then its log report, per mapping."""
    def play(feed: Feed) -> None:
        for s, values in enumerate(series, start=1):
            feed.step(s)
            feed.log(s, **values)
    return play


def then(*plays: Play) -> Play:
    def play(feed: Feed) -> None:
        for p in plays:
            p(feed)
    return play


def nothing(feed: Feed) -> None:
    """The run start alone."""


def quiet_for(seconds: float) -> Play:
    """One step, then the sidecar's clock moves on by seconds with nothing heard."""
    def play(feed: Feed) -> None:
        feed.step(1)
        feed.registry.tick(time.time() + seconds)
    return play


def inspected(**facts: Any) -> Play:
    """Two trained steps, then a checkpoint whose files the watcher read as facts say."""
    base: dict[str, Any] = dict(
        path="/c/checkpoint-2", weights_file="adapter_model.safetensors", is_adapter=True,
        adapter_digest="d1", tensor_digests={"a.lora_B.weight": "d1"}, tensor_count=1,
        tensor_bytes=64, method="LORA", identity="lora_B=0", adapter_tensors=1,
        adapter_params=16, identity_modules=1, moved_modules=1)

    def play(feed: Feed) -> None:
        steps(2)(feed)
        feed.checkpoint(2, D1, CheckpointInspection(**(base | facts)))
    return play


def start(config: dict[str, float] | None = None, trainer: str = "SFTTrainer",
          **facts: Any) -> dict[str, Any]:
    return {"trainer": trainer, "config": SFT if config is None else config, **facts}


def judged(config: dict[str, float], trainer: str = "SFTTrainer", modules: tuple[str, ...] = (),
           baseline_config: dict[str, float] | None = None, **series: float) -> dict[str, Any]:
    """A run's start that names a baseline of the recipe whose fingerprint is config's (or
    baseline_config's) and trainer's, whose module kinds all moved, and whose figures sit at
    the values given at every point of training."""
    recipe = pb.RunStart(trainer=trainer, config=baseline_config or config,
                         membership=MEMBERSHIP)
    baseline = Baseline(
        runs=("healthy",), steps=20, fingerprint=prints.fingerprint(recipe),
        modules={m: ModuleFacts(1.0, 2, Band(1.0, 1.0, 1.0)) for m in modules},
        series={q: tuple(Band(v, v, v) for _ in range(BINS)) for q, v in series.items()})
    return {**start(config, trainer), "baseline": baseline.to_json(),
            "baseline_name": "recipe.baseline.json"}


def moving(*kinds: str) -> list[pb.GroupUpdate]:
    """A step's module groups, each kind moved."""
    return [pb.GroupUpdate(name=k, kind="module", update_sq_sum=1e-6, tensors=2, elements=100,
                           dtype="float32") for k in kinds]


def peft(**preflight: Any) -> pb.Preflight:
    return pb.Preflight(is_peft=True, peft_type="LORA", **preflight)


def two_adapters(second_in_optimizer: int) -> pb.OptimizerMembership:
    membership = pb.OptimizerMembership()
    membership.CopyFrom(MEMBERSHIP)
    membership.adapters.extend([
        pb.AdapterCoverage(name="default", tensors=8, params=1024, in_optimizer_tensors=8),
        pb.AdapterCoverage(name="second", tensors=8, params=1024,
                           in_optimizer_tensors=second_in_optimizer)])
    return membership


def module_groups(unchanged: int) -> list[pb.GroupUpdate]:
    return [pb.GroupUpdate(name="attention", kind="module", update_sq_sum=1e-6, tensors=8,
                           elements=1000, unchanged_elements=unchanged, dtype="bfloat16")]


def two_ranks(play: Play) -> Play:
    """Rank 1 of a two-rank run registers too, then play."""
    def both(feed: Feed) -> None:
        feed.send(1, run_start=pb.RunStart(trainer="SFTTrainer", world_size=2,
                                           membership=MEMBERSHIP))
        play(feed)
    return both


def aged(feed: Feed, seconds: float, silent: tuple[int, ...] = ()) -> None:
    """The run's past moved back by seconds (its steps and step begins; the last messages of
    the silent ranks), then the sidecar's clock ticks."""
    run = feed.registry.run(feed.run_id)
    assert run is not None
    for rank in run.ranks.values():
        rank.last_step_time -= seconds
        rank.began_time -= seconds
        if rank.rank in silent:
            rank.last_seen -= seconds
    feed.registry.tick()


def stuck(began: dict[int, int]) -> Play:
    """Both ranks step 1-3; each then begins the step given; 61 s pass (the limit is 60)."""
    def play(feed: Feed) -> None:
        for rank in (0, 1):
            for s in (1, 2, 3):
                feed.step(s, rank=rank)
        for rank, step in began.items():
            feed.send(rank, heartbeat=pb.Heartbeat(step=step - 1, began_step=step))
        aged(feed, 61.0)
    return play


def timed(slow: float) -> Play:
    """Eight steps in which rank 1 works slow seconds, rank 0 a tenth of a second."""
    def play(feed: Feed) -> None:
        for s in range(1, 9):
            feed.step(s, rank=0, local_seconds=0.1)
            feed.step(s, rank=1, local_seconds=slow)
    return play


def replicas(apart: float) -> Play:
    """Both ranks sample their replicated weights at step 1; rank 1's differ by apart."""
    def play(feed: Feed) -> None:
        for rank, shift in ((0, 0.0), (1, apart)):
            feed.step(1, rank=rank)
            feed.send(rank, replica=pb.ReplicaDigest(
                step=1, structure="s", values=[0.5 + shift, 0.25, -0.125, 1.0],
                sizes=[2, 2], names=["a.weight", "b.weight"]))
    return play


def attested_job(feed: Feed) -> None:
    """This process, attested, registers rank 0, which unattested streams reported first."""
    attestor = feed.registry.attestor
    assert attestor is not None
    pid = os.getpid()
    started = start_time(pid)
    assert started is not None
    nonce = attestor.issue(ProcessIdentity(pid, os.getuid(), os.getgid(), started, boot_id()))
    feed.registry.ingest(pb.StreamRequest(run_id=feed.run_id, rank=0, events=[pb.Event(
        seq=1, run_start=pb.RunStart(trainer="SFTTrainer", attestation=nonce,
                                     membership=MEMBERSHIP))]), Peer(address="unix:"))


ROWS = [
    Row("empty_optimizer",
        Case(nothing, start(membership=pb.OptimizerMembership(adapter_params=1024,
                                                              adapter_tensors=8))),
        Case(nothing, start())),
    Row("grad_not_in_optimizer",
        Case(steps(1, grad_not_in_optimizer_tensors=4, grad_not_in_optimizer_params=64),
             start()),
        Case(steps(1), start())),
    Row("inactive_adapter",
        Case(nothing, start(membership=two_adapters(0))),
        Case(nothing, start(membership=two_adapters(8)))),
    Row("frozen_weights",
        Case(steps(3, update_sq=0.0), start()),
        Case(steps(3), start())),
    Row("decay_only_update",
        Case(steps(3, grad_norm=0.0), start(SFT | {"weight_decay": 0.1})),
        Case(steps(3), start(SFT | {"weight_decay": 0.1}))),
    Row("nonfinite_loss",
        Case(steps(1, loss=math.nan), start()),
        Case(steps(1), start())),
    Row("stalled",
        Case(quiet_for(400.0), start()),
        Case(quiet_for(1.0), start())),
    Row("partial_target_modules",
        Case(nothing, start(preflight=peft(requested_target_modules=["q_proj", "vproj"],
                                           unmatched_target_modules=["vproj"]))),
        Case(nothing, start(preflight=peft(requested_target_modules=["q_proj", "v_proj"])))),
    Row("embedding_resized",
        Case(nothing, start(preflight=peft(embedding_rows=322, base_vocab_size=320,
                                           embedding_module="embed_tokens"))),
        Case(nothing, start(preflight=peft(embedding_rows=320, base_vocab_size=320,
                                           embedding_module="embed_tokens")))),
    Row("lora_lr_too_low",
        Case(nothing, start(SFT | {"learning_rate": 1e-9}, preflight=peft())),
        Case(nothing, start(SFT, preflight=peft()))),
    Row("no_kl_anchor",
        Case(nothing, start(GRPO | {"beta": 0.0}, trainer="GRPOTrainer")),
        Case(nothing, start(GRPO, trainer="GRPOTrainer"))),
    Row("sharding_fallback",
        Case(nothing, start(requested_wrapper="fsdp2", wrapper="ddp")),
        Case(nothing, start(requested_wrapper="ddp", wrapper="ddp"))),
    Row("kl_missing",
        Case(logs({"loss": 0.0}, {"loss": 0.0}), start(GRPO, trainer="GRPOTrainer")),
        Case(logs({"loss": 0.0, "kl": 0.01}, {"loss": 0.0, "kl": 0.02}),
             start(GRPO, trainer="GRPOTrainer"))),
    Row("kl_stuck_zero",
        Case(logs(*[{"loss": 0.0, "kl": 0.0}] * 5), start(GRPO, trainer="GRPOTrainer")),
        Case(logs(*[{"loss": 0.0, "kl": 0.01}] * 5), start(GRPO, trainer="GRPOTrainer"))),
    Row("zero_reward_variance",
        Case(logs(*[{"frac_reward_zero_std": 1.0, "reward_std": 0.3}] * 4),
             start(GRPO, trainer="GRPOTrainer")),
        Case(logs(*[{"frac_reward_zero_std": 0.0, "reward_std": 0.3}] * 4),
             start(GRPO, trainer="GRPOTrainer"))),
    Row("entropy_collapse",
        Case(logs(*[{"entropy": 5.75}] * 3, {"entropy": 3.0}, {"entropy": 2.9},
                  {"entropy": 2.8}), start(GRPO, trainer="GRPOTrainer")),
        Case(logs(*[{"entropy": 5.75}] * 6), start(GRPO, trainer="GRPOTrainer"))),
    Row("completion_length_collapse",
        Case(logs(*[{"completions/mean_length": 120.0}] * 3,
                  *[{"completions/mean_length": 60.0}] * 3),
             start(GRPO, trainer="GRPOTrainer")),
        Case(logs(*[{"completions/mean_length": 120.0}] * 3,
                  *[{"completions/mean_length": 110.0}] * 3),
             start(GRPO, trainer="GRPOTrainer"))),
    Row("dpo_likelihood_collapse",
        Case(logs(*[{"rewards/chosen": -0.1 * i, "rewards/rejected": -0.2 * i,
                     "rewards/margins": 0.1 * i} for i in range(1, 6)]),
             start({"beta": 0.1, "learning_rate": 1e-6}, trainer="DPOTrainer")),
        Case(logs(*[{"rewards/chosen": 0.1 * i, "rewards/rejected": -0.2 * i,
                     "rewards/margins": 0.3 * i} for i in range(1, 6)]),
             start({"beta": 0.1, "learning_rate": 1e-6}, trainer="DPOTrainer"))),
    Row("zero_gradient",
        Case(steps(3, grad_norm=0.0), start()),
        Case(steps(3), start())),
    Row("optimizer_steps_skipped",  # the twin: a loss scale calibrating from the first step
        Case(then(steps(2), steps(3, first=3, optimizer_step_skipped=True)), start()),
        Case(steps(12, optimizer_step_skipped=True), start())),
    Row("low_precision_update",
        Case(steps(3, groups=module_groups(unchanged=500)), start()),
        Case(steps(3, groups=module_groups(unchanged=0)), start())),
    Row("stop_token_untrained",
        Case(nothing, start(stop_token=pb.StopTokenCheck(token="<|im_end|>", sequences=4,
                                                         in_inputs=4, in_labels=0))),
        Case(nothing, start(stop_token=pb.StopTokenCheck(token="<|im_end|>", sequences=4,
                                                         in_inputs=4, in_labels=4)))),
    Row("unsaved_head",
        Case(nothing, start(heads=pb.HeadCheck(heads=["score"], new_heads=["score"],
                                               trainable_heads=["score"]))),
        Case(nothing, start(heads=pb.HeadCheck(heads=["score"], new_heads=["score"],
                                               saved_heads=["score"],
                                               trainable_heads=["score"])))),
    Row("dataset_shrunk",
        Case(nothing, start(dataset_rows=pb.DatasetRows(given=100, kept=50))),
        Case(nothing, start(dataset_rows=pb.DatasetRows(given=100, kept=100)))),
    Row("resume_lost_adapter",
        Case(nothing, start(initial_adapter=D0, resume=pb.Resume(
            checkpoint="/c/checkpoint-4", step=4, checkpoint_adapter=D1))),
        Case(nothing, start(initial_adapter=D1, resume=pb.Resume(
            checkpoint="/c/checkpoint-4", step=4, checkpoint_adapter=D1)))),
    Row("adalora_not_allocated",
        Case(steps(6, adalora_rank_pattern_set=False),
             start(SFT | {"adalora_tinit": 1.0, "adalora_deltaT": 1.0,
                          "adalora_total_step": 20.0})),
        Case(steps(6, adalora_rank_pattern_set=True),
             start(SFT | {"adalora_tinit": 1.0, "adalora_deltaT": 1.0,
                          "adalora_total_step": 20.0}))),
    Row("completions_truncated",
        Case(logs(*[{"completions/clipped_ratio": 1.0,
                     "completions/mean_terminated_length": 0.0}] * 4),
             start(GRPO, trainer="GRPOTrainer")),
        Case(logs(*[{"completions/clipped_ratio": 0.5,
                     "completions/mean_terminated_length": 9.0}] * 4),
             start(GRPO, trainer="GRPOTrainer"))),
    Row("checkpoint_unchanged",
        Case(then(steps(1), lambda f: f.checkpoint(1, D1), steps(1, first=2),
                  lambda f: f.checkpoint(2, D1)), start(initial_adapter=D0)),
        Case(then(steps(1), lambda f: f.checkpoint(1, D1), steps(1, first=2),
                  lambda f: f.checkpoint(2, D2)), start(initial_adapter=D0))),
    Row("adapter_never_trained",
        Case(inspected(moved_modules=0), start()),
        Case(inspected(), start())),
    Row("adapter_bloat",
        Case(inspected(non_adapter=(("model.embed_tokens.weight", 20480),)), start()),
        Case(inspected(), start())),
    Row("empty_adapter",
        Case(inspected(tensor_digests={}, tensor_count=0, adapter_tensors=0,
                       identity_modules=0), start()),
        Case(inspected(), start())),
    Row("pickle_checkpoint",
        Case(inspected(pickle_files=("adapter_model.bin",)), start()),
        Case(inspected(), start())),
    Row("checkpoint_refused",
        Case(lambda f: f.registry.record_refusal(f.run_id, "/elsewhere/checkpoint-1",
                                                 "outside every --watch-root"), start()),
        Case(inspected(), start())),
    Row("base_weights_trained",
        Case(nothing, start(SFT | {"unsaved_trainable_params": 99_000.0,
                                   "model_params": 100_000.0}, preflight=peft())),
        Case(nothing, start(SFT | {"unsaved_trainable_params": 0.0,
                                   "model_params": 100_000.0}, preflight=peft()))),
    Row("trainable_out_of_band",
        Case(nothing, start(SFT | {"expected_trainable_pct_low": 0.5,
                                   "expected_trainable_pct_high": 5.0,
                                   "model_params": 10_000_000.0})),
        Case(nothing, start(SFT | {"expected_trainable_pct_low": 0.5,
                                   "expected_trainable_pct_high": 5.0,
                                   "model_params": 100_000.0}))),
    Row("declared_frozen_moved",
        Case(nothing, start(SFT | {"declared_frozen_tensors": 4.0,
                                   "declared_frozen_trainable_tensors": 2.0})),
        Case(steps(2), start(SFT | {"declared_frozen_tensors": 4.0,
                                    "declared_frozen_trainable_tensors": 0.0}))),
    Row("no_optimizer_step",
        Case(logs(*[{"loss": 2.0}] * 8), start()),
        Case(steps(8), start())),
    Row("loss_divergence",
        Case(logs(*[{"loss": v} for v in (2.0, 2.1, 1.9, 30.0, 45.0)]), start()),
        Case(logs(*[{"loss": v} for v in (2.0, 2.1, 1.9, 1.8, 1.7)]), start())),
    Row("grad_norm_spike",
        Case(logs(*[{"grad_norm": v} for v in (1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 400.0)]),
             start()),
        Case(logs(*[{"grad_norm": v} for v in (1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.02)]),
             start())),
    Row("gradient_accumulating",
        # summed gradients: the norm rises by one batch's gradient a step
        Case(stepped(*[{"grad_norm": 1.0 + i, "loss": 2.0} for i in range(10)]), start()),
        Case(stepped(*[{"grad_norm": 1.0, "loss": 2.0} for _ in range(10)]), start())),
    Row("negligible_updates",
        Case(steps(3, update_sq=1e-10, param_sq_sum=1e6), start()),
        Case(steps(3, update_sq=1e-6, param_sq_sum=1.0), start())),
    Row("step_out_of_order",
        Case(then(steps(5), lambda f: [f.step(3) for _ in range(3)]), start()),
        Case(steps(8), start())),
    Row("run_id_in_use",
        Case(attested_job, start()),
        Case(nothing, start()),
        attested=True),
    Row("rank_stalled",
        Case(two_ranks(stuck({0: 4, 1: 3})), start()),
        Case(two_ranks(stuck({0: 4, 1: 4})), start()),
        settings={"rank_stalled_seconds": 60.0}),
    Row("rank_straggler",
        Case(two_ranks(timed(0.5)), start()),
        Case(two_ranks(timed(0.1)), start())),
    Row("replicas_diverged",
        Case(two_ranks(replicas(0.1)), start()),
        Case(two_ranks(replicas(0.0)), start())),
    Row("rollout_stale",
        Case(logs(*[{"sampling/sampling_logp_difference/mean": v}
                    for v in (0.015, 0.016, 0.014, 0.2, 0.21, 0.22)]),
             start(GRPO, trainer="GRPOTrainer")),
        Case(logs(*[{"sampling/sampling_logp_difference/mean": v}
                    for v in (0.015, 0.016, 0.014, 0.015, 0.016, 0.015)]),
             start(GRPO, trainer="GRPOTrainer"))),
    Row("baseline_recipe_changed",
        Case(steps(3), judged(SFT, baseline_config={**SFT, "learning_rate": 1e-4})),
        Case(steps(3), judged(SFT))),
    Row("baseline_modules_changed",
        Case(steps(3, groups=moving("head", "stage0")), judged(SFT, modules=("head",))),
        Case(steps(3, groups=moving("head")), judged(SFT, modules=("head",)))),
    Row("baseline_learning_rate",
        Case(steps(8, lr=1e-5), judged(SFT, learning_rate=1e-4)),
        Case(steps(8), judged(SFT, learning_rate=1e-4))),
    Row("baseline_grad_norm",
        Case(steps(8, grad_norm=10.0), judged(SFT, grad_norm=1.0)),
        Case(steps(8), judged(SFT, grad_norm=1.0))),
    Row("baseline_update_size",
        Case(steps(8, update_sq=1e-4), judged(SFT, update_rms=1e-3 / 32)),
        Case(steps(8), judged(SFT, update_rms=1e-3 / 32))),
    Row("baseline_loss",
        Case(steps(8, loss=0.2), judged(SFT, loss=2.0)),
        Case(steps(8), judged(SFT, loss=2.0))),
    Row("baseline_rl_signals",
        Case(stepped(*[{"loss": 0.0, "kl": 0.01, "reward_std": 0.01}] * 6),
             judged(GRPO, "GRPOTrainer", reward_std=0.2)),
        Case(stepped(*[{"loss": 0.0, "kl": 0.01, "reward_std": 0.2}] * 6),
             judged(GRPO, "GRPOTrainer", reward_std=0.2))),
]
BY_ROW = {row.detector: row for row in ROWS}


def test_every_detector_has_a_row() -> None:
    assert len(BY_ROW) == len(ROWS), "a detector has two rows"
    assert set(BY_ROW) == set(BY_ID), (
        f"without a row: {sorted(set(BY_ID) - set(BY_ROW))}; "
        f"rows of no detector: {sorted(set(BY_ROW) - set(BY_ID))}")


def _play(row: Row, case: Case) -> set[str]:
    registry = Registry(settings=DetectorSettings(**row.settings),
                        attestor=Attestor() if row.attested else None)
    feed = Feed(registry, **case.start)
    case.play(feed)
    return feed.fired()


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.detector)
def test_it_fires_on_its_failure(row: Row) -> None:
    fired = _play(row, row.fires)
    assert row.detector in fired, f"{row.detector} stayed silent; fired: {sorted(fired)}"


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.detector)
def test_the_healthy_twin_stays_silent(row: Row) -> None:
    """Not only the row's detector: no detector at all fires on a healthy twin."""
    fired = _play(row, row.silent)
    assert not fired, f"the healthy twin of {row.detector} fired {sorted(fired)}"


def test_every_spec_says_what_healthy_runs_it_checked_and_where_it_misfires() -> None:
    """Severity discipline, written in each spec: the healthy recipes the detector stayed
    silent on (at least the healthy matrix, which runs every detector, and its twin in this
    table) and its known false-positive conditions, or why none is known."""
    for detector in ALL:
        spec = detector.spec
        assert MATRIX in spec.checked_against, spec.id
        assert CONFORMANCE_TWIN in spec.checked_against, spec.id
        assert len(set(spec.checked_against)) == len(spec.checked_against), spec.id
        for name in spec.checked_against:
            assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name), (spec.id, name)
        assert len(spec.false_positives.split()) >= 4, spec.id
        assert not spec.false_positives.endswith("."), spec.id


def test_a_critical_detector_knows_no_healthy_misfire_at_critical() -> None:
    """Critical means evidence a healthy run cannot produce: a critical spec's known false
    positives begin "none known" (a case a healthy run can produce fires at the spec's
    ``lower_severity``, and the text says so)."""
    for detector in ALL:
        spec = detector.spec
        if spec.severity.value == "critical":
            assert spec.false_positives.startswith("none known"), (spec.id,
                                                                    spec.false_positives)


def test_a_lower_severity_is_declared_with_when_and_is_lower() -> None:
    """A detector whose verdicts may carry a lower severity names it and says when (the
    generated tables print it), and it is lower than the spec's."""
    order = ["critical", "warning", "info"]
    for detector in ALL:
        spec = detector.spec
        if spec.lower_severity is None:
            assert not spec.lower_when, spec.id
            continue
        assert order.index(spec.lower_severity.value) > order.index(spec.severity.value), spec.id
        assert len(spec.lower_when.split()) >= 4, spec.id
