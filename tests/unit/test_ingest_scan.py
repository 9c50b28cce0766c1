"""One pass over a batch before it is applied: the caps of a step report are checked from its
serialized size (looked into only past ``SMALL_STEP_BYTES``), a refused batch is refused whole,
and the history the applied steps leave is the run's newest combined step, whichever rank,
sharding and order the batches come in."""

from __future__ import annotations

from pathlib import Path

import pytest

from deadweight.proto import pb
from deadweight.sidecar.model import limits
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import Store


def _start(sharded: bool = False, world_size: int = 1) -> pb.Event:
    return pb.Event(seq=0, run_start=pb.RunStart(trainer="SFTTrainer", sharded=sharded,
                                                 world_size=world_size))


def _step(seq: int, step: int, groups: list[pb.GroupUpdate] | None = None,
          update_sq: float = 1e-6) -> pb.Event:
    return pb.Event(seq=seq, step=pb.StepReport(
        step=step, learning_rate=1e-4, update_sq_sum=update_sq, watched_params=100,
        optimizer_params=100, watched_tensors=4, groups=groups or []))


def _send(registry: Registry, *events: pb.Event, rank: int = 0, run_id: str = "scan"
          ) -> pb.StreamResponse:
    return registry.ingest(pb.StreamRequest(run_id=run_id, rank=rank, events=list(events)))


def _group(name: str = "q_proj", kind: str = "module", dtype: str = "bfloat16"
           ) -> pb.GroupUpdate:
    return pb.GroupUpdate(name=name, kind=kind, dtype=dtype, update_sq_sum=1e-7, tensors=2,
                          elements=100)


@pytest.mark.parametrize(("groups", "problem"), [
    ([_group(name="n" * (limits.MAX_TEXT_LENGTH + 1))],
     f"step.groups has an entry longer than {limits.MAX_TEXT_LENGTH} characters"),
    ([_group(kind="k" * (limits.MAX_TEXT_LENGTH + 1))],
     f"step.groups has an entry longer than {limits.MAX_TEXT_LENGTH} characters"),
    ([_group(dtype="d" * (limits.MAX_TEXT_LENGTH + 1))],
     f"step.groups has an entry longer than {limits.MAX_TEXT_LENGTH} characters"),
    # empty groups: the smallest a client can send, 2 bytes each
    ([pb.GroupUpdate() for _ in range(limits.MAX_LIST_ENTRIES + 1)],
     f"step.groups has more than {limits.MAX_LIST_ENTRIES} entries"),
])
def test_an_oversized_step_refuses_its_whole_batch_naming_the_event(
    groups: list[pb.GroupUpdate], problem: str
) -> None:
    registry = Registry()
    assert not _send(registry, _start()).error
    assert _send(registry, _step(1, 1)).ack_seq == 1
    answer = _send(registry, _step(2, 2), _step(3, 3), _step(7, 4, groups), _step(8, 5))
    assert answer.error == f"event 2 (seq 7): {problem}"
    run = registry.run("scan")
    assert run is not None and run.step == 1  # the good steps before it were not applied
    assert [p.step for p in run.ranks[0].steps] == [1]
    assert _send(registry, _step(2, 2)).ack_seq == 2  # the stream goes on where it was


def test_steps_at_their_caps_are_kept() -> None:
    registry = Registry()
    assert not _send(registry, _start()).error
    at_cap = [_group(name="n" * limits.MAX_TEXT_LENGTH, kind="adapter")]
    many = [pb.GroupUpdate() for _ in range(limits.MAX_LIST_ENTRIES)]
    small = [_group()]
    events = [_step(1, 1, at_cap), _step(2, 2, many), _step(3, 3, small)]
    # the first two are looked into, the third is small enough to need no look
    assert [e.step.ByteSize() > limits.SMALL_STEP_BYTES for e in events] == [True, True, False]
    answer = _send(registry, *events)
    assert not answer.error and answer.ack_seq == 3
    run = registry.run("scan")
    assert run is not None and [p.step for p in run.ranks[0].steps] == [1, 2, 3]
    assert run.ranks[0].steps[2].module_elements == (("q_proj", "bfloat16", 100, 0),)


def _history(registry: Registry) -> list[tuple[int, float]]:
    return [(step, figures["update_norm"])
            for step, _, figures in registry.store.history("scan", "step")]


def test_the_history_keeps_the_lowest_rank_of_a_replicated_run(tmp_path: Path) -> None:
    registry = Registry(store=Store(tmp_path))
    assert not _send(registry, _start(world_size=2), rank=1).error
    assert not _send(registry, _step(1, 1, update_sq=4.0), _step(2, 2, update_sq=4.0),
                     rank=1).error
    assert _history(registry) == [(1, 2.0), (2, 2.0)]  # the only rank so far stands for all
    assert not _send(registry, _start(world_size=2), rank=0).error
    assert not _send(registry, _step(1, 1, update_sq=9.0), _step(2, 2, update_sq=16.0),
                     _step(3, 2, update_sq=1.0)).error  # steps already kept, and a repeat
    assert not _send(registry, _step(3, 3, update_sq=1.0), rank=1).error  # rank 0 stands now
    assert _history(registry) == [(1, 2.0), (2, 2.0)]
    assert not _send(registry, _step(4, 3, update_sq=9.0), _step(5, 4, update_sq=16.0)).error
    assert _history(registry) == [(1, 2.0), (2, 2.0), (3, 3.0), (4, 4.0)]


def test_the_history_sums_a_sharded_step_once_every_rank_sent_it(tmp_path: Path) -> None:
    registry = Registry(store=Store(tmp_path))
    for rank in (0, 1):
        assert not _send(registry, _start(world_size=2), rank=rank).error
    assert not _send(registry, _step(1, 1, update_sq=9.0)).error
    assert not _send(registry, _step(1, 1, update_sq=16.0), rank=1).error
    assert _history(registry) == [(1, 3.0)]  # replicated: rank 0 stands for both
    # rank 0 (which started the run) starts it again, sharded, and reports in the same batch:
    # from its RunStart on, a step is kept only once every rank sent its shard
    assert not _send(registry, _start(sharded=True, world_size=2),
                     _step(2, 2, update_sq=1.0), _step(3, 3, update_sq=1.0)).error
    assert _history(registry) == [(1, 3.0)]
    assert not _send(registry, _step(2, 2, update_sq=3.0), rank=1).error
    assert _history(registry) == [(1, 3.0), (2, 2.0)]
