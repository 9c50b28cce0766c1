"""One rank of a 2-rank gloo loop under ``deadweight.watch``: wrapped in DDP or not.

``python -m torch.distributed.run --nproc-per-node 2 unwrapped_worker.py MODES`` with MODES
one or more (comma-separated, run in turn) of ``unwrapped`` (each rank trains its own copy,
never wrapped: the replicas drift) and ``ddp``. DEADWEIGHT_ADDRESS and DEADWEIGHT_RUN_ID (each
run's id is ``$DEADWEIGHT_RUN_ID-<mode>``) come from the test.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import deadweight
from tests.support import loops


def main(modes: str) -> None:
    """Each mode of the comma-separated MODES in turn, in one process group; each run's id is
    ``$DEADWEIGHT_RUN_ID-<mode>``."""
    dist.init_process_group("gloo")
    base = os.environ["DEADWEIGHT_RUN_ID"]
    for mode in modes.split(","):
        os.environ["DEADWEIGHT_RUN_ID"] = f"{base}-{mode}"
        run(mode)
    dist.destroy_process_group()


def run(mode: str) -> None:
    model: torch.nn.Module = loops.model()
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with deadweight.watch(model, optimizer) as monitor:
        for i, (x, y) in enumerate(loops.batches(3, seed=1 + dist.get_rank()), start=1):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(i, loss=0.0)


if __name__ == "__main__":
    main(sys.argv[1])
