"""Checkpoint files for the watcher's fault and attack tests, and a run whose folder it watches.

A real ``deadweight serve`` is told about each folder as the callback's ``on_save`` would, and
its JSON log is read for the line that names the path and what happened to it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from tests.support.faults import Pipe
from tests.support.realprocs import wait_for


class Watched:
    """One registered run on the shared sidecar, and the sidecar's log lines about paths."""

    def __init__(self, sidecar: SidecarProcess, pipe: Pipe, run_id: str, out: Path) -> None:
        self.sidecar, self.pipe, self.run_id, self.out = sidecar, pipe, run_id, out
        self.seq = 0
        out.mkdir(parents=True)
        start = pb.RunStart(trainer="SFTTrainer", output_dir=str(out))
        assert not pipe.send(pb.StreamRequest(run_id=run_id,
                                              events=[pb.Event(run_start=start)])).error

    def report(self, folder: Path) -> None:
        """What the callback's on_save sends: the folder is complete (trusted)."""
        self.seq += 1
        event = pb.Event(seq=self.seq, checkpoint=pb.CheckpointReport(step=self.seq,
                                                                      path=str(folder)))
        assert not self.pipe.send(pb.StreamRequest(run_id=self.run_id, events=[event])).error

    def lines(self, path: Path) -> list[dict[str, Any]]:
        found = []
        for raw in self.sidecar.log_path.read_text(errors="replace").splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and str(path) in str(line.get("path", "")):
                found.append(line)
        return found

    def wait_line(self, path: Path, *events: str) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            return next((x for x in self.lines(path) if x.get("event") in events), None)

        line: dict[str, Any] = wait_for(find, 20, what=f"{events} for {path.name}")
        return line

    def still_works(self, name: str = "checkpoint-999") -> None:
        """A good checkpoint after the fault is inspected: the watcher kept running."""
        good = adapter(self.out / name)
        self.report(good)
        self.wait_line(good, "checkpoint_inspected")
        assert self.sidecar.process is not None and self.sidecar.process.poll() is None


def adapter(folder: Path, value: float = 0.5) -> Path:
    """A small LoRA adapter file (every element ``value``) in folder."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model.q_proj.lora_A.weight": np.full((4, 8), value, np.float32),
               "base_model.model.q_proj.lora_B.weight": np.full((8, 4), value, np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


def header_file(path: Path, header: bytes, data: bytes = b"\0" * 4) -> Path:
    """A safetensors-shaped file: the 8-byte length, the given header, then data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def many_tensors(path: Path, count: int) -> Path:
    """A valid safetensors file with count one-element tensors (all share 4 bytes)."""
    parts = (f'"t{i:07d}":{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
             for i in range(count))
    return header_file(path, ("{" + ",".join(parts) + "}").encode())


def sparse_safetensors(path: Path, nbytes: int) -> None:
    """A valid safetensors file with one huge all-zero tensor, sparse on disk."""
    header = json.dumps({"base_model.model.q_proj.lora_A.weight": {
        "dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}).encode()
    header_file(path, header, b"")
    with path.open("r+b") as handle:
        handle.truncate(8 + len(header) + nbytes)
