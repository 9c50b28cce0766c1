"""The checkpoint inspector and watcher on real files: digests, zeros, bad headers, completeness."""

from __future__ import annotations

import json
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deadweight.callbacks import digest
from deadweight.demo import runs
from deadweight.sidecar.checkpoints.adapter_methods import Value
from deadweight.sidecar.checkpoints.inspector import NotACheckpoint, hash_file, inspect_path
from deadweight.sidecar.checkpoints.watcher import CheckpointWatcher
from deadweight.sidecar.model.inspection import CheckpointInspection
from tests.support.realprocs import wait_for


def test_file_digests_equal_the_callbacks_in_memory_digests(tmp_path: Path) -> None:
    model_dir, adapter_dir = runs.prepare(tmp_path, "llama")
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    memory = digest.digest_adapter(model)
    files = inspect_path(adapter_dir)
    assert files.tensor_digests == memory.tensors
    assert files.adapter_digest == memory.combined
    assert files.tensor_bytes == memory.bytes
    assert files.identity_modules == files.moved_modules > 0
    assert files.method == "LORA" and files.identity == "lora_B=0 or lora_embedding_B=0"

    model = model.to(torch.bfloat16)  # the saved dtype is what is hashed, in both places
    model.save_pretrained(tmp_path / "bf16")
    assert inspect_path(tmp_path / "bf16").adapter_digest == digest.digest_adapter(model).combined


def test_exact_zero_ignores_the_sign_and_nothing_else(tmp_path: Path) -> None:
    tensors = {
        "m.q_proj.lora_B.weight": torch.tensor([[0.0, -0.0]], dtype=torch.bfloat16),
        "m.v_proj.lora_B.weight": torch.tensor([[0.0, 1e-30]], dtype=torch.float32),
        "m.k_proj.lora_B.weight": torch.tensor([[-0.0, 0.0]], dtype=torch.float16),
        "m.q_proj.lora_A.weight": torch.ones(1, 2),
    }
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    facts = {t.name: t.constant for t in hash_file(tmp_path / "adapter_model.safetensors")}
    assert facts == {"m.q_proj.lora_B.weight": Value.ZERO, "m.v_proj.lora_B.weight": None,
                     "m.k_proj.lora_B.weight": Value.ZERO, "m.q_proj.lora_A.weight": None}


def test_exact_one_per_dtype_for_identities_that_start_at_ones(tmp_path: Path) -> None:
    """IA3 starts at ones: every float width is read as bytes, 1 + one ULP is not one."""
    tensors = {
        "m.q_proj.ia3_l": torch.ones(3, dtype=torch.bfloat16),
        "m.k_proj.ia3_l": torch.ones(3, dtype=torch.float16),
        "m.v_proj.ia3_l": torch.ones(3, dtype=torch.float64),
        "m.o_proj.ia3_l": torch.tensor([1.0, 1.0, float(torch.nextafter(
            torch.tensor(1.0), torch.tensor(2.0)))]),
    }
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    facts = {t.name: t.constant for t in hash_file(tmp_path / "adapter_model.safetensors")}
    assert facts == {"m.q_proj.ia3_l": Value.ONE, "m.k_proj.ia3_l": Value.ONE,
                     "m.v_proj.ia3_l": Value.ONE, "m.o_proj.ia3_l": None}
    inspection = inspect_path(tmp_path)
    assert (inspection.method, inspection.identity_modules, inspection.moved_modules) == (
        "IA3", 4, 1)
    assert inspection.non_adapter == () and inspection.adapter_params == 12


def _raw_safetensors(path: Path, header: dict[str, object], data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_invalid_files_are_not_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "noise.safetensors").write_bytes(b"\xff" * 64)
    _raw_safetensors(tmp_path / "short.safetensors",
                     {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    for name in ("noise.safetensors", "short.safetensors", "empty", "notes.txt", "missing"):
        with pytest.raises(NotACheckpoint):
            inspect_path(tmp_path / name)


def test_trainer_resume_pickles_are_not_flagged_weight_pickles_are(tmp_path: Path) -> None:
    save_file({"x.lora_B.weight": torch.ones(2, 2)}, str(tmp_path / "adapter_model.safetensors"))
    for name in ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (tmp_path / name).write_bytes(b"pickle")
    assert inspect_path(tmp_path).pickle_files == ()
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    assert inspect_path(tmp_path).pickle_files == ("adapter_model.bin",)


class Sink:
    def __init__(self) -> None:
        self.seen: list[tuple[str, CheckpointInspection, int]] = []
        self.lock = threading.Lock()

    def record_inspection(self, run_id: str, inspection: CheckpointInspection,
                          step: int = 0, incarnation: int | None = None) -> bool:
        with self.lock:
            self.seen.append((run_id, inspection, step))
        return True


def _passes(watcher: CheckpointWatcher, more: int) -> None:
    """Wait until the watcher has completed `more` further passes of its loop."""
    target = watcher.passes + more
    wait_for(lambda: watcher.passes >= target, 20, what=f"{more} more watcher passes")


class WatcherClock:
    """The watcher's wall clock, moved by the test: settling becomes a condition, not a race
    between a sleep in the test and the watcher's own timing."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


def test_watcher_waits_for_a_complete_folder_created_after_registration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = WatcherClock()
    monkeypatch.setattr(sys.modules[CheckpointWatcher.__module__], "time", clock)
    sink = Sink()
    watcher = CheckpointWatcher(sink, settle_seconds=0.5, scan_seconds=0.05,
                                roots=[tmp_path])
    watcher.start()
    try:
        output = tmp_path / "out"  # does not exist yet: the Trainer creates it at its first save
        watcher.watch("run", str(output))
        folder = output / "checkpoint-5"
        folder.mkdir(parents=True)
        weights = folder / "adapter_model.safetensors"
        tensors = {"m.q_proj.lora_A.weight": torch.ones(64, 64),
                   "m.q_proj.lora_B.weight": torch.ones(64, 64)}
        save_file(tensors, str(tmp_path / "staged.safetensors"))
        staged = (tmp_path / "staged.safetensors").read_bytes()
        with weights.open("wb") as handle:  # a slow writer: half now, half after a pause
            handle.write(staged[: len(staged) // 2])
            handle.flush()
            _passes(watcher, 3)  # it found the half-written folder
            clock.now += 0.4  # unchanged for less than the settle time
            _passes(watcher, 3)
            assert not sink.seen, "inspected a half-written file"
            handle.write(staged[len(staged) // 2:])
        _passes(watcher, 3)  # it saw the file change: the settle clock starts again
        clock.now += 0.3  # 0.7 s since the folder appeared, 0.3 s since its last change
        _passes(watcher, 3)
        assert not sink.seen, "inspected a file that changed less than settle_seconds ago"
        clock.now += 0.3
        wait_for(lambda: sink.seen, 20, what="the watcher to inspect the finished checkpoint")
        _passes(watcher, 3)  # it looked again, more than once: no second inspection
        assert len(sink.seen) == 1
        run_id, inspection, step = sink.seen[0]
        assert (run_id, step, inspection.path) == ("run", 5, str(folder))
        assert inspection.moved_modules == 1
        assert inspection.tensor_bytes == 2 * 64 * 64 * 4  # the whole file, not its first half

        watcher.submit("run", str(folder))  # the callback's report of the same files
        _passes(watcher, 2)  # the report was drained and settled
        assert len(sink.seen) == 1
    finally:
        watcher.stop()


def test_method_from_names_when_the_config_is_missing(tmp_path: Path) -> None:
    """A bare adapter file still gets its method's names and identity; a full model is no
    adapter; an unknown peft_type judges nothing untrained and calls nothing bloat."""
    cases = {
        "adalora": ({"m.q_proj.lora_A": torch.ones(2, 4), "m.q_proj.lora_E": torch.zeros(2, 1),
                     "m.q_proj.lora_B": torch.ones(4, 2)}, "ADALORA", (1, 0)),
        "loha": ({"m.q_proj.hada_w1_a": torch.ones(4, 2), "m.q_proj.hada_w1_b": torch.ones(2, 4),
                  "m.q_proj.hada_w2_a": torch.ones(4, 2),
                  "m.q_proj.hada_w2_b": torch.zeros(2, 4)}, "LOHA", (1, 0)),
        "boft": ({"m.q_proj.boft_R": torch.zeros(1, 2, 2, 2),
                  "m.q_proj.boft_s": torch.full((4, 1), 1.5)}, "BOFT", (1, 1)),
    }
    for name, (tensors, method, counts) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        inspection = inspect_path(folder)
        assert inspection.method == method
        assert (inspection.identity_modules, inspection.moved_modules) == counts
        assert inspection.non_adapter == ()

    save_file({"model.layers.0.q_proj.weight": torch.ones(4, 4)},
              str(tmp_path / "full.safetensors"))
    full = inspect_path(tmp_path / "full.safetensors")
    assert not full.is_adapter and full.method == "" and full.non_adapter == ()

    odd = tmp_path / "odd"
    odd.mkdir()
    save_file({"m.q_proj.newmethod_w": torch.zeros(2, 2)}, str(odd / "adapter_model.safetensors"))
    (odd / "adapter_config.json").write_text('{"peft_type": "NEWMETHOD"}')
    unknown = inspect_path(odd)
    assert unknown.method == "UNKNOWN" and unknown.identity_modules == 0


def test_a_checkpoint_of_one_life_never_lands_on_the_next(tmp_path: Path) -> None:
    """A run id used again (a relaunch): the watcher gets to life 1's last checkpoint only
    after life 2 registered (a busy watcher). That inspection is life 1's: it is not added
    to life 2's chain, whose own checkpoint, found in its own folder, is."""
    from deadweight.proto import pb
    from deadweight.sidecar.registry import Registry
    from tests.support.checkpoint_files import adapter

    registry = Registry()
    watcher = CheckpointWatcher(registry, settle_seconds=0.05, scan_seconds=0.05,
                                roots=[tmp_path])
    registry.attach_watcher(watcher)  # not started yet: its requests wait in its queue

    def send(*events: pb.Event) -> None:
        answer = registry.ingest(pb.StreamRequest(run_id="again", events=list(events)))
        assert not answer.error, answer.error

    first, second = tmp_path / "life1", tmp_path / "life2"
    send(pb.Event(seq=1, run_start=pb.RunStart(trainer="SFTTrainer", output_dir=str(first))))
    old = adapter(first / "checkpoint-4")
    send(pb.Event(seq=2, checkpoint=pb.CheckpointReport(step=4, path=str(old))))
    send(pb.Event(seq=3, run_end=pb.RunEnd(reason="completed")))
    send(pb.Event(seq=1, run_start=pb.RunStart(trainer="SFTTrainer", output_dir=str(second))))
    new = adapter(second / "checkpoint-2", value=0.25)

    def inspected_own() -> bool:
        run = registry.run("again")
        point = run.checkpoint(str(new)) if run is not None else None
        return point is not None and point.inspection is not None

    watcher.start()
    try:
        wait_for(inspected_own, 20, what="life 2's own checkpoint inspected")
        wait_for(lambda: watcher.inspected == 2, 20, what="life 1's checkpoint read too")
        _passes(watcher, 2)
        run = registry.run("again")
        assert run is not None and run.incarnation == 2
        assert [c.path for c in run.checkpoints] == [str(new)]
    finally:
        watcher.stop()
