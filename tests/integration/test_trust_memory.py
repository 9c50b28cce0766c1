"""The manifest's memory limit holds the worst case its caps allow, measured on a real sidecar.

``bench/sidecar_memory.py`` starts a real ``deadweight serve`` with the manifest's
memory-relevant flags and drives it to every cap at once (runs, ranks, steps, adapter
groups, log keys and values, checkpoint reports, the largest checkpoint header under the watch
root, Status and /metrics); its peak RSS (``VmHWM``) must stay under the manifest's
``limits.memory``, and one rank beyond ``--max-ranks`` must be refused. Memory, not time, is
asserted: the run takes about 40 s here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import sidecar_memory
from deadweight.proto import pb
from deadweight.sidecar.model.inspection import CheckpointInspection
from deadweight.sidecar.model.run_state import CheckpointPoint, RunState
from deadweight.sidecar.registry import Registry

pytestmark = pytest.mark.slow  # memory, not time, is asserted: it may share the machine


def test_peak_memory_at_every_cap_stays_under_the_manifest_limit(tmp_path: Path) -> None:
    found = sidecar_memory.manifest()
    assert set(found.flags) == set(sidecar_memory.MEMORY_FLAGS), found.flags
    shape = sidecar_memory.Shape.worst(found.flags["--max-runs"], found.flags["--max-ranks"])
    result = sidecar_memory.measure(tmp_path, found.flags, shape)
    # Every run's largest header was inspected, and the rank cap is what bounds the ranks.
    assert result.inspected >= shape.runs
    assert result.refused_rank == f"sidecar already holds {shape.ranks} ranks"
    # The workload really loaded the sidecar: far above an idle one.
    assert result.peak_bytes > result.idle_peak_bytes + 256 * sidecar_memory.MIB
    assert result.peak_bytes <= found.limit_bytes, (
        f"peak {result.peak_bytes / sidecar_memory.MIB:.0f} MiB over the manifest's "
        f"limit {found.limit_bytes / sidecar_memory.MIB:.0f} MiB")
    assert found.request_bytes < found.limit_bytes


def _request(run_id: str, rank: int, *events: pb.Event) -> pb.StreamRequest:
    return pb.StreamRequest(run_id=run_id, rank=rank, events=list(events))


def test_ranks_beyond_max_ranks_are_refused_until_an_ended_run_makes_room() -> None:
    registry = Registry(max_ranks=2)
    start = pb.Event(seq=1, run_start=pb.RunStart(trainer="SFTTrainer"))
    beat = pb.Event(seq=2, heartbeat=pb.Heartbeat(step=1))
    assert not registry.ingest(_request("a", 0, start)).error
    assert not registry.ingest(_request("a", 1, beat)).error
    refused = registry.ingest(_request("b", 0, start))
    assert refused.error == "sidecar already holds 2 ranks"
    assert registry.refusals["capacity"] == 1
    # A rank the run already has is never refused.
    assert not registry.ingest(_request("a", 1, pb.Event(seq=3, heartbeat=pb.Heartbeat(
        step=2)))).error
    assert not registry.ingest(_request("a", 0, pb.Event(seq=2, run_end=pb.RunEnd(
        reason="completed")))).error
    assert not registry.ingest(_request("b", 0, start)).error  # "a" ended: forgotten for room
    assert [r.run_id for r in registry.status().runs] == ["b"]


def test_only_the_two_newest_checkpoints_keep_their_per_tensor_digests() -> None:
    run = RunState("r")
    points = [CheckpointPoint(step=i, path=f"/out/checkpoint-{i}", combined_digest=f"{i:032x}",
                              tensor_digests={f"t{j}": f"{i}-{j}" for j in range(100)},
                              adapter_bytes=400, time=float(i),
                              inspection=CheckpointInspection(
                                  path=f"/out/checkpoint-{i}", weights_file="a.safetensors",
                                  tensor_digests={f"t{j}": "d" for j in range(100)},
                                  tensor_count=100))
              for i in range(1, 4)]
    for point in points:
        run.add_checkpoint(point)
    assert [len(p.tensor_digests) for p in run.checkpoints] == [0, 100, 100]
    inspections = [p.inspection for p in run.checkpoints]
    assert [len(i.tensor_digests) for i in inspections if i] == [0, 100, 100]
    assert [i.tensor_count for i in inspections if i] == [100, 100, 100]
    assert [p.digest for p in run.checkpoints] == [f"{i:032x}" for i in range(1, 4)]
