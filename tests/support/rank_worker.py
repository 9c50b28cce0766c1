"""One rank of a 2-rank raw PyTorch loop (``torchrun --nproc-per-node 2``, gloo on CPU) with
``deadweight.watch``, for the per-rank detectors.

Usage: ``torchrun --nproc-per-node 2 tests/support/rank_worker.py MODES OUT_DIR STEPS`` with
``DEADWEIGHT_ADDRESS`` set; MODES is one mode or several, comma-separated, run one after the
other in one launch (STEPS then lists each one's steps). A mode:

- ``healthy``: DDP, every rank at full speed (the twin of the three below).
- ``stall``: DDP; after optimizer step ``STALL_AFTER`` the stuck rank (rank 1, or
  ``DEADWEIGHT_TEST_STUCK_RANK``) stays in its own loop (as a rank stuck on its data or in
  user code would) until the file OUT_DIR/release appears, while the other ranks go on into
  the next step and block in its gradient all-reduce.
- ``straggler``: DDP; rank 1 spends ``STRAGGLE_SECONDS`` of its own before every forward pass
  (a slow data loader), so rank 0 waits for it at every all-reduce.
- ``unwrapped``: the model is never wrapped in DDP; each rank trains on its own data, so the
  two replicas drift apart from the first step.
- ``init``: DDP without its initial broadcast (``init_sync=False``, as when each rank restores
  its own checkpoint) and rank 1 starts from other weights: the gradients are averaged, the
  replicas stay apart.

The replica modes wait after each step until the sidecar acknowledged what the rank sent, as a
step of a real model gives it time to (a loop of six 1 ms steps ends before the first batch
leaves); the timing modes do not, so nothing but the loop itself is timed.

A rank reports to ``DEADWEIGHT_ADDRESS_RANK<N>`` where it is set (each node's sidecar serves
only its own ranks), else to ``DEADWEIGHT_ADDRESS``.

Each rank writes ``rank<N>.json``: run id, steps, and the wall time of each optimizer step.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The Monitor's methods whose host reads the healthy twin counts.
HOOKS = ("_before_step", "_after_step", "log")
STALL_AFTER = 3
STRAGGLE_SECONDS = 0.15
#: Longest rank 1 stays stuck when nobody releases it (the test releases it far sooner).
STALL_LIMIT_SECONDS = 120.0
LR = 1e-2


def _net(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _acknowledged(monitor: Any) -> None:
    """Until the sidecar acknowledged every event this rank queued (a condition, not a sleep)."""
    client = monitor.client
    deadline = time.monotonic() + 10
    while client is not None and (client.queued or client._inflight):
        if time.monotonic() > deadline:
            raise TimeoutError("the sidecar never acknowledged this rank's events")
        time.sleep(0.005)  # poll interval of the condition wait


def main(modes: str, out: Path, steps: str) -> int:
    """Run each mode of the comma-separated MODES for its number of STEPS, one after the other
    in this process group; with several, each run's id is ``$DEADWEIGHT_RUN_ID-<mode>`` and
    its report goes to ``OUT/<mode>/``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runs = list(zip(modes.split(","), (int(n) for n in steps.split(",")), strict=True))
    base = os.environ.get("DEADWEIGHT_RUN_ID", "")
    for mode, count in runs:
        if len(runs) > 1:
            os.environ["DEADWEIGHT_RUN_ID"] = f"{base}-{mode}"
        folder = out / mode if len(runs) > 1 else out
        folder.mkdir(parents=True, exist_ok=True)
        run(mode, folder, count)
    dist.destroy_process_group()
    return 0


def run(mode: str, out: Path, steps: int) -> None:
    """One monitored run of the loop in one mode; writes this rank's report to out."""
    import torch
    import torch.distributed as dist

    import deadweight
    from deadweight.callbacks.stream_client import ClientSettings

    rank = dist.get_rank()
    node_address = os.environ.get(f"DEADWEIGHT_ADDRESS_RANK{rank}")
    if node_address:
        os.environ["DEADWEIGHT_ADDRESS"] = node_address
    stuck_rank = int(os.environ.get("DEADWEIGHT_TEST_STUCK_RANK", "1"))
    torch.manual_seed(100 + rank)  # each rank its own shard of the data
    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(steps)]
    model: Any = _net(seed=1 if mode == "init" and rank == 1 else 0)
    if mode != "unwrapped":
        model = torch.nn.parallel.DistributedDataParallel(model, init_sync=mode != "init")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    step_times: list[float] = []
    settings = ClientSettings(heartbeat_seconds=0.2)
    # The healthy twin counts the host reads in deadweight's hooks after its first step
    # (``bench.host_reads``; the launch forces the device path, DEADWEIGHT_UPDATE_PATH=device).
    from bench.host_reads import HookMeter, HostReads
    from deadweight.callbacks.watch import Monitor

    reads = HostReads()
    counting = mode == "healthy"
    meter = HookMeter(Monitor, HOOKS, reads)
    # The meter first: watch binds the step hooks it wraps when it starts.
    with meter if counting else contextlib.nullcontext(), deadweight.watch(
            model, optimizer, settings=settings, start_timeout_seconds=5.0) as monitor:
        for step, (x, y) in enumerate(batches, start=1):
            if counting and step == 2:
                reads.__enter__()  # from the second step on
            if mode == "straggler" and rank == 1:
                time.sleep(STRAGGLE_SECONDS)  # the slow rank's own work: not a test wait
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss)
            step_times.append(time.time())
            if mode in ("unwrapped", "init"):
                _acknowledged(monitor)
            if mode == "stall" and rank == stuck_rank and step == STALL_AFTER:
                release = out / "release"
                deadline = time.monotonic() + STALL_LIMIT_SECONDS
                while not release.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)  # the stuck rank: its loop makes no progress
        if counting:
            reads.__exit__(None, None, None)
        report = {"rank": rank, "run_id": monitor.run_id, "steps": monitor.step,
                  "step_times": step_times,
                  "host_reads_in_hooks": sum(n for label, n in reads.where.items()
                                             if label in HOOKS),
                  "hooks_measured": sorted(meter.seconds),
                  "dropped": monitor.client.dropped if monitor.client else -1}
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
