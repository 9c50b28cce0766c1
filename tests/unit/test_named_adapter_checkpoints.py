"""A run that trains a named adapter (``add_adapter`` + ``set_adapter``): PEFT saves it into
``checkpoint-N/<name>/``, beside the "default" adapter in ``checkpoint-N/`` itself. The watcher
inspects the adapter the run trains, as its start reported it.

Before, it read the folder's own file, the "default" adapter that did not train: a healthy
second adapter's checkpoints looked byte-identical (a critical ``checkpoint_unchanged``), and
a second adapter that never moved looked fine beside a default that changed.
"""

from __future__ import annotations

from pathlib import Path

from deadweight.proto import pb
from deadweight.sidecar.checkpoints.watcher import CheckpointWatcher, adapter_folder
from deadweight.sidecar.registry import Registry
from tests.support.checkpoint_files import adapter
from tests.support.realprocs import wait_for


def _run(tmp_path: Path, run_id: str, default: tuple[float, float],
         second: tuple[float, float]) -> Registry:
    """A run training adapter "second": two checkpoints, each with the default adapter at the
    folder's top and the second in its subfolder, every element at the values given."""
    registry = Registry()
    watcher = CheckpointWatcher(registry, settle_seconds=0.05, scan_seconds=0.05,
                                roots=[tmp_path])
    registry.attach_watcher(watcher)
    out = tmp_path / run_id
    preflight = pb.Preflight(is_peft=True, peft_type="LORA", active_adapter="second")
    events = [pb.Event(seq=1, run_start=pb.RunStart(trainer="SFTTrainer", output_dir=str(out),
                                                    preflight=preflight))]
    for seq, step, top, named in ((2, 2, default[0], second[0]), (3, 4, default[1], second[1])):
        folder = adapter(out / f"checkpoint-{step}", top)
        adapter(folder / "second", named)
        events.append(pb.Event(seq=seq, checkpoint=pb.CheckpointReport(step=step,
                                                                       path=str(folder))))
    watcher.start()
    try:
        for event in events:
            assert not registry.ingest(pb.StreamRequest(run_id=run_id, events=[event])).error

        def inspected() -> bool:
            run = registry.run(run_id)
            return run is not None and len(run.checkpoints) == 2 and all(
                p.inspection is not None for p in run.checkpoints)

        wait_for(inspected, 20, what=f"both checkpoints of {run_id} inspected")
    finally:
        watcher.stop()
    return registry


def test_the_named_adapter_that_trains_is_inspected_not_the_idle_default(
        tmp_path: Path) -> None:
    registry = _run(tmp_path, "trains", default=(0.5, 0.5), second=(0.25, 0.125))
    run = registry.run("trains")
    assert run is not None
    assert [p.path for p in run.checkpoints] == [  # the checkpoints the run reported
        str(tmp_path / "trains" / f"checkpoint-{s}") for s in (2, 4)]
    assert len({p.digest for p in run.checkpoints}) == 2
    assert "checkpoint_unchanged" not in registry.findings("trains")


def test_a_named_adapter_that_never_moves_is_caught_beside_a_default_that_did(
        tmp_path: Path) -> None:
    registry = _run(tmp_path, "stuck", default=(0.5, 0.75), second=(0.25, 0.25))
    unchanged = registry.findings("stuck")["checkpoint_unchanged"]
    assert unchanged.firing and unchanged.evidence["same_as"] == "previous (step 2)"


def test_only_a_plain_folder_name_is_followed(tmp_path: Path) -> None:
    folder = adapter(tmp_path / "checkpoint-1")
    adapter(folder / "second")
    assert adapter_folder(folder, "second") == folder / "second"
    assert adapter_folder(folder, "default") == folder
    assert adapter_folder(folder, "missing") == folder  # nothing saved there: the top
    for name in ("", "..", "../checkpoint-1", "/etc", "second/.."):
        assert adapter_folder(folder, name) == folder
