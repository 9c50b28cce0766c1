"""One run on a real ``Registry``, fed wire events one by one: how unit tests drive detectors."""

from __future__ import annotations

from deadweight.proto import pb
from deadweight.sidecar.model.inspection import CheckpointInspection
from deadweight.sidecar.registry import Registry

#: Membership of a healthy adapter run: 8 tensors, all in the optimizer.
MEMBERSHIP = pb.OptimizerMembership(optimizer_tensors=8, optimizer_params=1024,
                                    adapter_params=1024, adapter_tensors=8)


class Feed:
    """One run on a registry, fed event by event."""

    def __init__(self, registry: Registry, trainer: str = "GRPOTrainer",
                 config: dict[str, float] | None = None, run_id: str = "r",
                 membership: pb.OptimizerMembership | None = None, **start: object) -> None:
        self.registry, self.run_id, self.seq = registry, run_id, 0
        self.send(run_start=pb.RunStart(trainer=trainer, config=config or {},
                                        membership=membership or MEMBERSHIP,
                                        **start))  # type: ignore[arg-type]

    def send(self, rank: int = 0, **body: object) -> pb.StreamResponse:
        self.seq += 1
        seq = 0 if "heartbeat" in body else self.seq  # heartbeats carry no sequence number
        event = pb.Event(seq=seq, **body)  # type: ignore[arg-type]
        return self.registry.ingest(pb.StreamRequest(run_id=self.run_id, rank=rank,
                                                     events=[event]))

    def step(self, step: int, lr: float = 1e-4, update_sq: float = 1e-6, rank: int = 0,
             **kw: object) -> None:
        self.send(rank, step=pb.StepReport(step=step, learning_rate=lr, update_sq_sum=update_sq,
                                           watched_params=1024, optimizer_params=1024,
                                           watched_tensors=8, **kw))  # type: ignore[arg-type]

    def log(self, step: int, **values: float) -> None:
        self.send(log=pb.LogReport(step=step, values=values))

    def checkpoint(self, step: int, digest: pb.AdapterDigest | None = None,
                   inspection: CheckpointInspection | None = None) -> None:
        """A checkpoint the run reports, and what the watcher then read from its files."""
        path = f"/c/checkpoint-{step}"
        self.send(checkpoint=pb.CheckpointReport(step=step, path=path, adapter=digest))
        if inspection is not None:
            self.registry.record_inspection(self.run_id, inspection, step)

    def fired(self) -> set[str]:
        return {k for k, f in self.registry.findings(self.run_id).items() if f.incidents}
