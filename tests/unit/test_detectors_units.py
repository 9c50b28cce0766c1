"""Detector edge cases fed as wire events into a Registry: the healthy facts that must not alarm.

The real-trainer tests (``test_catalogue_*``) prove each detector on the real failure; these
pin the boundaries cheaply: windows, warmup, single flat steps, relative (not absolute)
trends, the stall clock, and artifact verdicts that outlive their run.
"""

from __future__ import annotations

from deadweight.proto import pb
from deadweight.sidecar.model.inspection import CheckpointInspection
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Registry
from tests.support.detector_feed import Feed

GRPO = {"beta": 0.04, "num_generations": 2.0, "learning_rate": 1e-4, "total_steps": 20}


def test_a_single_flat_reward_step_is_healthy_a_window_is_not() -> None:
    feed = Feed(Registry(settings=DetectorSettings(zero_reward_logs=3)), config=GRPO)
    for step, frac in enumerate([0, 1, 0, 1, 0, 1, 1], start=1):
        feed.log(step, frac_reward_zero_std=float(frac), reward_std=0.3, kl=0.01)
    assert "zero_reward_variance" not in feed.fired()
    feed.log(8, frac_reward_zero_std=1.0, reward_std=0.3, kl=0.01)
    finding = feed.registry.findings("r")["zero_reward_variance"]
    assert finding.firing and finding.evidence["frac_reward_zero_std"] == "1"
    assert finding.evidence["reward_std"] == "0.3"
    # The groups spread until step 5: a saturated task can go flat healthily for a while.
    assert finding.severity == "warning" and finding.evidence["spread_until_step"] == "5"


def test_a_reward_that_never_spread_is_critical_one_that_went_flat_is_a_warning() -> None:
    """Flat from the first report: the reward cannot rank completions (critical). Flat after
    spreading (a task solved, binary rewards late in training): warning, by either measure
    (the trainer's frac_reward_zero_std, or every function's std without it)."""
    severity = {}
    for name, fracs in (("never", [1, 1, 1]), ("went_flat", [0.5, 0.25, 1, 1, 1])):
        feed = Feed(Registry(settings=DetectorSettings(zero_reward_logs=3)), config=GRPO,
                    run_id=name)
        for step, frac in enumerate(fracs, start=1):
            feed.log(step, frac_reward_zero_std=float(frac), reward_std=0.3, kl=0.01)
        severity[name] = feed.registry.findings(name)["zero_reward_variance"].severity
    for name, stds in (("fn_never", [0, 0, 0]), ("fn_went_flat", [0.4, 0, 0, 0])):
        feed = Feed(Registry(settings=DetectorSettings(zero_reward_logs=3)), config=GRPO,
                    run_id=name)
        for step, std in enumerate(stds, start=1):
            feed.log(step, **{"rewards/accuracy/std": float(std)}, kl=0.01)
        severity[name] = feed.registry.findings(name)["zero_reward_variance"].severity
    assert severity == {"never": "critical", "went_flat": "warning",
                        "fn_never": "critical", "fn_went_flat": "warning"}


def test_reward_std_alone_never_trips_zero_reward_variance() -> None:
    feed = Feed(Registry(), config=GRPO)
    for step in range(1, 10):
        feed.log(step, reward_std=0.0, frac_reward_zero_std=0.0, **{"rewards/f/std": 0.2})
    assert "zero_reward_variance" not in feed.fired()


def test_kl_zero_at_step_one_and_during_warmup_is_expected() -> None:
    config = {**GRPO, "resolved_warmup_steps": 2.0}
    feed = Feed(Registry(settings=DetectorSettings(kl_zero_logs=3)), config=config)
    for step, kl in [(1, 0.0), (2, 0.0), (3, 0.0), (4, 1e-5), (5, 0.0), (6, 0.0)]:
        feed.log(step, kl=kl, loss=0.0)
    assert "kl_stuck_zero" not in feed.fired()
    feed.log(7, kl=0.0, loss=0.0)
    assert feed.registry.findings("r")["kl_stuck_zero"].evidence["steps"] == "5-7"


def test_constant_entropy_never_collapses_a_relative_drop_does() -> None:
    feed = Feed(Registry(settings=DetectorSettings(trend_logs=3)), config=GRPO)
    for step in range(1, 13):
        feed.log(step, entropy=5.75)
    assert "entropy_collapse" not in feed.fired()
    for step, value in [(13, 3.0), (14, 2.9), (15, 2.8)]:
        feed.log(step, entropy=value)
    evidence = feed.registry.findings("r")["entropy_collapse"].evidence
    assert evidence["baseline"] == "5.75" and evidence["current"] == "2.9"


def test_decay_only_needs_weight_decay_and_exactly_zero_gradients() -> None:
    feed = Feed(Registry(settings=DetectorSettings(decay_only_steps=3)),
                config={**GRPO, "weight_decay": 0.0})
    for step in range(1, 6):
        feed.step(step)
        feed.log(step, grad_norm=0.0, loss=0.0)
    assert "decay_only_update" not in feed.fired()  # Adam momentum, not decay

    feed = Feed(Registry(settings=DetectorSettings(decay_only_steps=3)),
                config={**GRPO, "weight_decay": 0.1}, run_id="wd")
    for step in range(1, 4):
        feed.step(step)
        feed.log(step, grad_norm=0.0 if step > 1 else 1e-3, loss=0.0)
    assert "decay_only_update" not in feed.fired()
    feed.step(4)
    feed.log(4, grad_norm=0.0, loss=0.0)
    assert feed.registry.findings("wd")["decay_only_update"].evidence["steps"] == "2-4"


def test_stalled_follows_the_clock_and_heartbeats() -> None:
    registry = Registry(settings=DetectorSettings(stalled_seconds=60, stalled_step_seconds=600))
    feed = Feed(registry, config=GRPO)
    feed.step(1)
    run = registry.run("r")
    assert run is not None
    now = run.last_seen
    registry.tick(now + 30)
    assert "stalled" not in feed.fired()
    registry.tick(now + 61)
    silence = registry.findings("r")["stalled"]
    assert silence.firing and silence.severity == "critical"  # gone, frozen or suspended
    feed.send(heartbeat=pb.Heartbeat(step=1))
    registry.tick(run.last_seen + 1)
    assert not registry.findings("r")["stalled"].firing  # alive again
    run.ranks[0].last_step_time -= 601  # the last step is 601 s old, the heartbeat fresh
    registry.tick(run.last_seen + 1)  # heartbeats alone do not hide a loop that stopped stepping
    hung = registry.findings("r")["stalled"]
    assert hung.firing and "no optimizer step" in hung.summary
    # The process still beats: a hung loop, or a very long healthy step (a huge generation,
    # a checkpoint upload): a warning, not a page.
    assert hung.severity == "warning"


def test_lr_zero_after_warmup_flags_but_warmup_does_not() -> None:
    config = {"learning_rate": 1e-4, "resolved_warmup_steps": 2.0, "total_steps": 10.0}
    feed = Feed(Registry(), trainer="SFTTrainer", config=config)
    for step in (1, 2):
        feed.step(step, lr=0.0, update_sq=0.0)
    assert "lora_lr_too_low" not in feed.fired()
    for step in (3, 4, 5, 6):
        feed.step(step, lr=0.0, update_sq=0.0)
    assert feed.registry.findings("r")["lora_lr_too_low"].evidence["step"] == "6"


def test_dpo_margin_growing_with_chosen_rising_is_healthy() -> None:
    feed = Feed(Registry(settings=DetectorSettings(dpo_window=4)), trainer="DPOTrainer")
    for step in range(1, 8):
        feed.log(step, **{"rewards/chosen": 0.1 * step, "rewards/rejected": -0.1 * step,
                          "rewards/margins": 0.2 * step})
    assert "dpo_likelihood_collapse" not in feed.fired()
    for step in range(8, 12):
        feed.log(step, **{"rewards/chosen": -0.2 * step, "rewards/rejected": -0.3 * step,
                          "rewards/margins": 0.1 * step})
    assert "dpo_likelihood_collapse" in feed.fired()


def test_dpo_chosen_dipping_and_levelling_off_under_a_growing_margin_is_healthy() -> None:
    """Likelihood displacement: both rewards below the reference and falling a little while
    the margin opens well past chosen's dip. Not a collapse."""
    feed = Feed(Registry(settings=DetectorSettings(dpo_window=4)), trainer="DPOTrainer")
    chosen = [-0.010, -0.020, -0.026, -0.030, -0.032, -0.033, -0.034]
    for step, c in enumerate(chosen, start=1):
        margin = 0.01 * step
        feed.log(step, **{"rewards/chosen": c, "rewards/rejected": c - margin,
                          "rewards/margins": margin})
    assert "dpo_likelihood_collapse" not in feed.fired()


def test_a_constant_format_reward_beside_a_varying_one_is_not_zero_reward_variance() -> None:
    """The advantage comes from the combined reward: a constant shape reward beside a varying
    one leaves the groups spread (frac_reward_zero_std < 1)."""
    feed = Feed(Registry(settings=DetectorSettings(zero_reward_logs=3)), config=GRPO)
    for step in range(1, 8):
        feed.log(step, frac_reward_zero_std=0.0, reward_std=0.2,
                 **{"rewards/format/std": 0.0, "rewards/accuracy/std": 0.2})
    assert "zero_reward_variance" not in feed.fired()


def test_without_frac_every_function_constant_is_zero_reward_variance_one_is_not() -> None:
    feed = Feed(Registry(settings=DetectorSettings(zero_reward_logs=3)), config=GRPO)
    for step in range(1, 5):
        feed.log(step, reward_std=0.2, **{"rewards/format/std": 0.0,
                                          "rewards/accuracy/std": 0.2})
    assert "zero_reward_variance" not in feed.fired()
    for step in range(5, 8):
        feed.log(step, reward_std=0.0, **{"rewards/format/std": 0.0,
                                          "rewards/accuracy/std": 0.0})
    finding = feed.registry.findings("r")["zero_reward_variance"]
    assert finding.firing
    assert finding.evidence["rewards/format/std"] == finding.evidence["rewards/accuracy/std"]


#: An adapter digest "d0" (a real digest names the tensors behind it).
D0 = pb.AdapterDigest(combined="d0", tensors={"a.lora_B.weight": "t0"})


def _inspection(path: str, digest: str, lora_b_nonzero: int = 1,
                pickles: tuple[str, ...] = ()) -> CheckpointInspection:
    return CheckpointInspection(path=path, weights_file="adapter_model.safetensors",
                                is_adapter=True, adapter_digest=digest,
                                tensor_digests={"a.lora_B.weight": digest}, tensor_bytes=64,
                                method="LORA", adapter_tensors=1, adapter_params=16,
                                identity_modules=1, moved_modules=lora_b_nonzero,
                                pickle_files=pickles)


def test_checkpoint_at_warmups_lr_zero_step_is_not_unchanged() -> None:
    config = {"learning_rate": 1e-4, "resolved_warmup_steps": 2.0, "total_steps": 10.0}
    initial = D0
    feed = Feed(Registry(), trainer="SFTTrainer", config=config, initial_adapter=initial)
    feed.step(1, lr=0.0, update_sq=0.0)
    feed.send(checkpoint=pb.CheckpointReport(step=1, path="/c/checkpoint-1",
                                             adapter=D0))
    assert "checkpoint_unchanged" not in feed.fired()
    feed.step(2, lr=5e-5)
    feed.send(checkpoint=pb.CheckpointReport(step=2, path="/c/checkpoint-2",
                                             adapter=D0))
    finding = feed.registry.findings("r")["checkpoint_unchanged"]
    assert finding.firing and finding.evidence["same_as"] == "previous (step 1)"
    run = feed.registry.run("r")
    assert run is not None and run.checkpoints_unchanged == 1


def test_artifact_verdicts_outlive_the_run_and_files_overrule_memory() -> None:
    registry = Registry()
    feed = Feed(registry, trainer="SFTTrainer", config={"learning_rate": 1e-4},
                initial_adapter=D0)
    feed.step(1)
    feed.send(checkpoint=pb.CheckpointReport(step=1, path="/c/checkpoint-1",
                                             adapter=D0))
    feed.send(run_end=pb.RunEnd(step=1, reason="completed"))
    assert registry.findings("r")["checkpoint_unchanged"].firing  # still, after the end
    # The watcher then reads the files: they differ from the initial adapter after all.
    registry.record_inspection("r", _inspection("/c/checkpoint-1", "d1", lora_b_nonzero=0,
                                                pickles=("adapter_model.bin",)), 1)
    findings = registry.findings("r")
    assert not findings["checkpoint_unchanged"].firing
    assert findings["adapter_never_trained"].firing
    assert findings["pickle_checkpoint"].evidence["pickle_files"] == "adapter_model.bin"
    run = registry.run("r")
    assert run is not None and run.checkpoints_total == 1
    assert run.checkpoints_unchanged == 1  # a counter never goes down
    assert not findings.get("frozen_weights")  # run-scoped verdicts stay resolved


def _adapters_at_start(run_id: str, trainer: str, *adapters: pb.AdapterCoverage) -> Registry:
    membership = pb.OptimizerMembership(optimizer_tensors=8, optimizer_params=1024,
                                        adapters=list(adapters))
    registry = Registry()
    registry.ingest(pb.StreamRequest(run_id=run_id, events=[pb.Event(seq=1, run_start=pb.RunStart(
        trainer=trainer, membership=membership))]))
    return registry


def test_reference_copy_is_not_idle_under_any_trainer_but_a_second_adapter_is() -> None:
    """TRL's frozen "ref" copy of the trained adapter (DPO, KTO, GRPO, RLOO) is exempt by what
    it is, whatever the trainer; an adapter named so that is no copy of it is not."""
    trained = pb.AdapterCoverage(name="default", tensors=8, params=1024, in_optimizer_tensors=8,
                                 active=True)
    copy = pb.AdapterCoverage(name="ref", tensors=8, params=1024, in_optimizer_tensors=0)
    for trainer in ("GRPOTrainer", "KTOTrainer", "SomeFutureTrainer"):
        registry = _adapters_at_start("r", trainer, trained, copy)
        assert "inactive_adapter" not in registry.findings("r")
    other = pb.AdapterCoverage(name="ref", tensors=4, params=256, in_optimizer_tensors=0)
    registry = _adapters_at_start("sft", "SFTTrainer", trained, other)
    assert registry.findings("sft")["inactive_adapter"].evidence["idle_adapters"] == "ref"


def test_an_earlier_adapter_left_frozen_is_not_idle_a_newer_one_is() -> None:
    """Adapters trained one after another: the earlier one stays frozen while the newer one,
    activated, trains. The newer one left idle while the earlier trains is F6."""
    first = pb.AdapterCoverage(name="first", tensors=8, params=1024, in_optimizer_tensors=0)
    second = pb.AdapterCoverage(name="second", tensors=8, params=1024, in_optimizer_tensors=8,
                                active=True)
    registry = _adapters_at_start("seq", "SFTTrainer", first, second)
    assert "inactive_adapter" not in registry.findings("seq")
    first_trains = pb.AdapterCoverage(name="first", tensors=8, params=1024,
                                      in_optimizer_tensors=8, active=True)
    never = pb.AdapterCoverage(name="second", tensors=8, params=1024, in_optimizer_tensors=0)
    registry = _adapters_at_start("f6", "SFTTrainer", first_trains, never)
    assert registry.findings("f6")["inactive_adapter"].evidence["idle_adapters"] == "second"


def test_an_idle_inactive_adapter_is_a_warning_an_idle_active_one_critical() -> None:
    """An inactive adapter kept out of the optimizer may be loaded on purpose (to compare
    against, for inference): a warning. The active adapter out of the optimizer while another
    trains never trains: critical."""
    trains = pb.AdapterCoverage(name="default", tensors=8, params=1024, in_optimizer_tensors=8)
    loaded = pb.AdapterCoverage(name="compare", tensors=8, params=1024, in_optimizer_tensors=0)
    registry = _adapters_at_start("loaded", "SFTTrainer", trains, loaded)
    assert registry.findings("loaded")["inactive_adapter"].severity == "warning"
    active = pb.AdapterCoverage(name="compare", tensors=8, params=1024, in_optimizer_tensors=0,
                                active=True)
    registry = _adapters_at_start("active", "SFTTrainer", trains, active)
    assert registry.findings("active")["inactive_adapter"].severity == "critical"


def test_an_unsaved_head_is_critical_under_a_trainer_a_warning_in_a_raw_loop() -> None:
    """A Trainer saves a PEFT model through the adapter: the head is lost from every
    checkpoint. A raw loop may save the head itself."""
    heads = pb.HeadCheck(heads=["score"], new_heads=["score"], trainable_heads=["score"])
    severity = {}
    for loop in ("trainer", "watch"):
        registry = Registry()
        registry.ingest(pb.StreamRequest(run_id=loop, events=[pb.Event(
            seq=1, run_start=pb.RunStart(trainer="RewardTrainer", heads=heads,
                                         config_text={"loop": loop}))]))
        severity[loop] = registry.findings(loop)["unsaved_head"].severity
    assert severity == {"trainer": "critical", "watch": "warning"}


def test_stall_clock_starts_when_the_rank_is_heard_not_at_run_creation() -> None:
    registry = Registry(settings=DetectorSettings(stalled_seconds=60, stalled_step_seconds=600))
    feed = Feed(registry, config=GRPO)
    run = registry.run("r")
    assert run is not None
    run.created -= 3600  # a run restored from the store after a sidecar restart
    registry.tick(run.last_seen + 30)
    assert "stalled" not in feed.fired()
    run.ranks.clear()  # restored, no rank reconnected yet: no clock to judge by
    registry.tick(run.created + 7200)
    assert "stalled" not in feed.fired()


def test_a_resize_fires_unless_its_new_rows_train_on_purpose() -> None:
    """Only the embedding's own module counts: saving lm_head alone leaves the rows random."""
    cases = {"none": {}, "lm_head_only": {"modules_to_save": ["lm_head"]},
             "saved": {"modules_to_save": ["embed_tokens", "lm_head"]},
             "trainable_tokens": {"trainable_token_modules": ["embed_tokens"]}}
    fired = {}
    for name, covered in cases.items():
        preflight = pb.Preflight(is_peft=True, embedding_rows=322, base_vocab_size=320,
                                 embedding_module="embed_tokens", **covered)
        feed = Feed(Registry(), trainer="SFTTrainer", run_id=name, preflight=preflight)
        fired[name] = "embedding_resized" in feed.fired()
    assert fired == {"none": True, "lm_head_only": True, "saved": False,
                     "trainable_tokens": False}


def test_digests_over_no_tensors_are_never_compared() -> None:
    """A full fine-tune has no adapter: its (empty) digests are all equal and mean nothing."""
    empty = pb.AdapterDigest(combined="e")  # what a digest of no tensors looks like
    feed = Feed(Registry(), trainer="SFTTrainer", config={"learning_rate": 1e-4},
                initial_adapter=empty)
    for step in (1, 2):
        feed.step(step)
        feed.send(checkpoint=pb.CheckpointReport(step=step, path=f"/c/checkpoint-{step}",
                                                 adapter=empty))
    assert "checkpoint_unchanged" not in feed.fired()


def _bf16_step(feed: Feed, step: int, unchanged: int, lr: float = 2e-4,
               dtype: str = "bfloat16", update_sq: float = 1e-6) -> None:
    group = pb.GroupUpdate(name="q_proj", kind="module", tensors=2, elements=1000,
                           unchanged_elements=unchanged, dtype=dtype)
    feed.step(step, lr=lr, update_sq=update_sq, groups=[group])


def test_low_precision_counts_only_steps_that_should_move_every_element() -> None:
    """Warmup, lr 0, a zero gradient and a frozen step neither
    count nor fire; three counted steps that keep a quarter of a bf16 kind do."""
    settings = DetectorSettings(low_precision_fraction=0.25, low_precision_steps=3)
    config = {"learning_rate": 2e-4, "warmup_steps": 2.0}
    held = {"bfloat16": 1000}
    feed = Feed(Registry(settings=settings), trainer="SFTTrainer", config=config,
                trainable_params_by_dtype=held)
    _bf16_step(feed, 1, 1000, lr=0.0)  # warmup's lr 0
    _bf16_step(feed, 2, 900, lr=1e-5)  # warmup
    _bf16_step(feed, 3, 500)
    feed.log(3, grad_norm=0.0, loss=0.69)  # no gradient: zero_gradient's case
    _bf16_step(feed, 4, 500)
    _bf16_step(feed, 5, 1000, update_sq=0.0)  # nothing moved: frozen_weights' case
    _bf16_step(feed, 6, 500)
    assert "low_precision_update" not in feed.fired()
    _bf16_step(feed, 7, 400)
    finding = feed.registry.findings("r")["low_precision_update"]
    assert finding.firing and finding.step == 7 and finding.evidence["dtype"] == "bfloat16"
    assert finding.evidence["module_kind"] == "q_proj"
    _bf16_step(feed, 8, 10)  # updates land again (a larger lr): the verdict recovers
    assert not feed.registry.findings("r")["low_precision_update"].firing


def test_low_precision_needs_low_precision_weights_in_the_optimizer() -> None:
    """The same counts in fp32 (a healthy LoRA's first step), or in bf16 copies of fp32 master
    weights the optimizer holds, lose nothing."""
    settings = DetectorSettings(low_precision_fraction=0.25, low_precision_steps=2)
    fired = {}
    for name, dtype, held in (("fp32", "float32", {"float32": 1000}),
                              ("master", "bfloat16", {"float32": 1000}),
                              ("bf16", "bfloat16", {"bfloat16": 1000})):
        feed = Feed(Registry(settings=settings), trainer="SFTTrainer", run_id=name,
                    config={"learning_rate": 2e-4}, trainable_params_by_dtype=held)
        for step in (1, 2, 3):
            _bf16_step(feed, step, 600, dtype=dtype)
        fired[name] = "low_precision_update" in feed.fired()
    assert fired == {"fp32": False, "master": False, "bf16": True}


def test_resume_loss_sign_needs_a_run_that_had_learned() -> None:
    """Back at the first loss fires only when the checkpoint's run had learned, once a loss
    after the resume arrives, and never for RL losses (GRPO's sits near 0 by design)."""
    resume = pb.Resume(checkpoint="/c/checkpoint-8", step=8, first_loss=5.8, last_loss=3.6)
    fired = {}
    for name, trainer, first, after in (("restarted", "SFTTrainer", 5.8, 5.7),
                                        ("went_on", "SFTTrainer", 5.8, 3.7),
                                        ("never_learned", "SFTTrainer", 3.7, 3.7),
                                        ("rl", "GRPOTrainer", 5.8, 5.7)):
        resume.first_loss = first
        feed = Feed(Registry(), trainer=trainer, run_id=name, resume=resume)
        assert "resume_lost_adapter" not in feed.fired()  # no loss since the resume yet
        feed.log(9, loss=after)
        fired[name] = "resume_lost_adapter" in feed.fired()
        if fired[name]:  # a heuristic: a healthy resume onto new data can raise the loss too
            [run] = feed.registry.status(name).runs
            severity = {f.detector: f.severity for f in run.findings}["resume_lost_adapter"]
            assert severity == "warning"
    assert fired == {"restarted": True, "went_on": False, "never_learned": False, "rl": False}


def test_a_streak_names_the_item_where_it_reached_its_length() -> None:
    from deadweight.sidecar.detectors.base import trailing_streak

    streak = trailing_streak([1, 0, 0, 0, 0], lambda v: v == 0)
    assert streak.items == (0, 0, 0, 0) and len(streak) == 4
    assert streak.reached(3) == 0 and streak.reached(5) is None and streak.reached(0) is None
    steps = trailing_streak([(1, 0.0), (2, 1.0), (3, 0.0), (4, 0.0)], lambda p: p[1] == 0)
    assert steps.reached(2) == (4, 0.0) and steps.reached(1) == (3, 0.0)
    assert not trailing_streak([0, 1], lambda v: v == 0).items  # the newest breaks it


def test_start_fact_detectors_wait_for_the_start_and_stay_silent_without_their_fact() -> None:
    """Before the RunStart a start-fact detector has nothing to judge (no verdict at all); a
    RunStart without the optional fact (the client could not gather it) is a silent verdict,
    while the same fact present and bad fires."""
    from deadweight.sidecar.detectors.base import Verdict
    from deadweight.sidecar.detectors.start_facts import (
        DatasetShrunk,
        ResumeLostAdapter,
        StopTokenUntrained,
        UnsavedHead,
    )
    from deadweight.sidecar.model.run_state import RunState

    settings = DetectorSettings()
    detectors = (StopTokenUntrained(), UnsavedHead(), DatasetShrunk(), ResumeLostAdapter())
    run = RunState("r")
    assert [d.evaluate(run, settings) for d in detectors] == [None] * 4
    run.start = pb.RunStart(trainer="SFTTrainer")
    assert [d.evaluate(run, settings) for d in detectors] == [Verdict(False)] * 4
    run.start = pb.RunStart(trainer="SFTTrainer", dataset_rows=pb.DatasetRows(given=32, kept=2),
                            stop_token=pb.StopTokenCheck(sequences=4, in_inputs=4, in_labels=0,
                                                         token="<eos>"))
    fired = [d.spec.id for d in detectors if (v := d.evaluate(run, settings)) and v.firing]
    assert fired == ["stop_token_untrained", "dataset_shrunk"]


def test_no_stop_token_in_raw_text_is_pretraining_in_a_masked_prompt_run_it_fires() -> None:
    """No stop token anywhere in the data: raw text trained on every token (continued
    pre-training) has nothing to stop; a run whose loss leaves the prompt out trains answers
    that must end."""
    from deadweight.sidecar.detectors.base import Verdict
    from deadweight.sidecar.detectors.start_facts import StopTokenUntrained
    from deadweight.sidecar.model.run_state import RunState

    run = RunState("r")
    raw = pb.StopTokenCheck(sequences=8, in_inputs=0, in_labels=0, full_rows=2, outside_loss=0)
    run.start = pb.RunStart(trainer="Trainer", stop_token=raw)
    assert StopTokenUntrained().evaluate(run, DetectorSettings()) == Verdict(False)
    masked = pb.StopTokenCheck(sequences=8, in_inputs=0, in_labels=0, full_rows=2,
                               outside_loss=40)
    run.start = pb.RunStart(trainer="Trainer", stop_token=masked)
    verdict = StopTokenUntrained().evaluate(run, DetectorSettings())
    assert verdict is not None and verdict.firing and verdict.evidence["outside_loss"] == "40"


def _accumulating(norms: list[float], losses: list[float], **start: object) -> set[str]:
    feed = Feed(Registry(), trainer="Sequential", config={"learning_rate": 1e-3}, **start)
    for step, (norm, loss) in enumerate(zip(norms, losses, strict=True), start=1):
        feed.step(step)
        feed.log(step, grad_norm=norm, loss=loss)
    return feed.fired() & {"gradient_accumulating"}


def test_gradient_accumulating_needs_a_summed_rise_and_a_loss_that_does_not_learn() -> None:
    noisy = [2.8, 2.9, 1.8, 2.2, 1.9, 1.4, 1.5, 1.4, 0.8, 1.7]  # a loop's jumping batches
    summed = [0.056, 0.109, 0.148, 0.181, 0.222, 0.244, 0.267, 0.289, 0.301, 0.333]
    assert _accumulating(summed, noisy) == {"gradient_accumulating"}
    # the same rise under a Trainer, which clears gradients itself
    trainer = {"config_text": {"loop": "trainer"}}
    assert not _accumulating(summed, noisy, **trainer)
    # a rise that speeds up (a saddle left, a head growing) is no sum
    speeding = [0.053, 0.055, 0.059, 0.064, 0.071, 0.081, 0.094, 0.109, 0.127, 0.148]
    assert not _accumulating(speeding, noisy)
    # a steady rise while the loss falls at every log is a run that learns
    falling = [1.39 - 0.01 * i for i in range(10)]
    assert not _accumulating(summed, falling)


def test_lora_lr_is_the_rate_the_optimizer_really_uses() -> None:
    def fired(config: dict[str, float]) -> bool:
        feed = Feed(Registry(), trainer="SFTTrainer", config={"total_steps": 10, **config},
                    preflight=pb.Preflight(is_peft=True))
        feed.step(1, lr=1e-3)
        return "lora_lr_too_low" in feed.fired()

    assert fired({"learning_rate": 2e-5})  # F9: the full fine-tune default, really used
    assert fired({"learning_rate": 2e-4, "optimizer_lr": 1e-6})  # its own optimizer's rate
    assert not fired({"learning_rate": 2e-5, "optimizer_lr": 2e-4})
    # Adafactor's relative_step ignores the configured rate
    assert not fired({"learning_rate": 2e-5, "optimizer_relative_step": 1.0})


def test_one_nan_batch_is_a_warning_that_clears_a_nan_streak_is_critical() -> None:
    """One bad batch whose NaN the next log recovers from: a warning, resolved by the finite
    log. NaN for nonfinite_logs reports in a row: the incident steps up to critical."""
    nan = float("nan")
    feed = Feed(Registry(settings=DetectorSettings(nonfinite_logs=3)), trainer="SFTTrainer",
                run_id="r")
    feed.step(1)
    feed.log(1, loss=2.0, grad_norm=0.5)
    feed.step(2)
    feed.log(2, loss=nan, grad_norm=0.5)
    blip = feed.registry.findings("r")["nonfinite_loss"]
    assert blip.firing and blip.severity == "warning" and blip.step == 2
    feed.step(3)
    feed.log(3, loss=1.9, grad_norm=0.5)
    assert not feed.registry.findings("r")["nonfinite_loss"].firing  # the batch recovered
    for step in (4, 5, 6):
        feed.step(step)
        feed.log(step, loss=nan, grad_norm=nan)
        finding = feed.registry.findings("r")["nonfinite_loss"]
        assert finding.firing and finding.step == 4
        assert finding.severity == ("critical" if step == 6 else "warning"), step


def test_nonfinite_weights_are_critical_at_once() -> None:
    feed = Feed(Registry(settings=DetectorSettings(nonfinite_logs=3)), trainer="SFTTrainer",
                run_id="w")
    feed.step(1)
    feed.log(1, loss=2.0, grad_norm=0.5)
    feed.step(2, nonfinite_update_tensors=2)
    finding = feed.registry.findings("w")["nonfinite_loss"]
    assert finding.firing and finding.severity == "critical"


def _schedule_run(run_id: str, lrs: list[float], moved_per_lr: float,
                  settings: DetectorSettings | None = None, first: int = 1) -> set[str]:
    """A run whose every step moves the weights (norm 1) by moved_per_lr times its lr; the
    sidecar sees it from step ``first`` on (a resumed run, or a sidecar restarted)."""
    feed = Feed(Registry(settings=settings), trainer="SFTTrainer", run_id=run_id,
                config={"learning_rate": max(lrs), "total_steps": len(lrs)})
    for step, lr in enumerate(lrs, start=1):
        if step >= first:
            feed.step(step, lr=lr, update_sq=(moved_per_lr * lr) ** 2, param_sq_sum=1.0)
    return feed.fired()


def test_a_cosine_schedule_s_tail_is_not_negligible_a_tiny_peak_is() -> None:
    """The last steps of a long cosine schedule run at a millionth of its peak and move
    nothing, by design: a run that trained at its peak stays silent. A peak of 1e-9, a warmup
    that never ends at a tiny rate, or a flat tiny rate still fire."""
    import math

    def cosine(peak: float, steps: int, warmup: int = 10) -> list[float]:
        return [peak * s / warmup if s < warmup else
                peak * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))
                for s in range(1, steps + 1)]

    # A large model: its steps move it by 1e-5 of its norm at the peak, its last hundred by
    # under 1e-6; the peak is long out of the sidecar's step window (256) by then.
    healthy, moved = cosine(1e-3, 1000), 0.01
    assert all(0 < moved * lr < 1e-6 for lr in healthy[-101:-1])
    assert "negligible_updates" not in _schedule_run("cosine", healthy, moved)
    # the tail judged like any other step fires
    judged = DetectorSettings(negligible_decayed_lr_share=0.0)
    assert "negligible_updates" in _schedule_run("cosine-judged", healthy, moved, judged)
    # a sidecar that sees only the tail (restarted, or a resumed run) takes the configured peak
    assert "negligible_updates" not in _schedule_run("tail-only", healthy, moved, first=800)
    assert "negligible_updates" in _schedule_run("cosine-1e-9", cosine(1e-9, 300), 2.0)
    rising = [1e-9 * s for s in range(1, 40)]  # warmup 100000 steps long: always rising
    assert "negligible_updates" in _schedule_run("endless-warmup", rising, 2.0)
    assert "negligible_updates" in _schedule_run("flat", [1e-9] * 20, 2.0)


def test_the_lora_floor_of_preference_and_rl_trainers_is_their_own() -> None:
    """A DPO or GRPO LoRA at 5e-6 (the published QLoRA DPO recipe) trains; at their full
    fine-tune default 1e-6 it does not. An SFT LoRA at 5e-6 is still below its floor."""
    def fired(trainer: str, lr: float) -> bool:
        feed = Feed(Registry(), trainer=trainer, run_id=f"{trainer}-{lr}",
                    config={"learning_rate": lr, "total_steps": 10},
                    preflight=pb.Preflight(is_peft=True))
        feed.step(1, lr=lr)
        return "lora_lr_too_low" in feed.fired()

    for trainer in ("DPOTrainer", "GRPOTrainer", "KTOTrainer"):
        assert not fired(trainer, 5e-6), trainer
        assert fired(trainer, 1e-6), trainer
    assert fired("SFTTrainer", 5e-6) and not fired("SFTTrainer", 1e-4)


def test_the_lora_lr_fix_names_the_range_of_the_run_s_kind() -> None:
    """A DPO LoRA below its floor is told the DPO-family range, not the SFT one."""
    from deadweight.sidecar import detectors

    fixes = {}
    for trainer in ("DPOTrainer", "SFTTrainer"):
        feed = Feed(Registry(), trainer=trainer, run_id=trainer,
                    config={"learning_rate": 1e-6, "total_steps": 10},
                    preflight=pb.Preflight(is_peft=True))
        feed.step(1, lr=1e-6)
        finding = feed.registry.findings(trainer)["lora_lr_too_low"]
        fixes[trainer] = detectors.fix_sentence("lora_lr_too_low", finding.evidence)
    assert "`5e-6` to `5e-5`" in fixes["DPOTrainer"] and "1e-4" not in fixes["DPOTrainer"]
    assert "`learning_rate=1e-4` to `2e-4`" in fixes["SFTTrainer"]
