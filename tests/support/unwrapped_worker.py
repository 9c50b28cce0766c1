"""One rank of a 2-rank gloo loop under ``deadweight.watch``: wrapped in DDP or not.

``python -m torch.distributed.run --nproc-per-node 2 unwrapped_worker.py MODE`` with MODE
``unwrapped`` (each rank trains its own copy, never wrapped: the replicas drift) or ``ddp``.
DEADWEIGHT_ADDRESS and DEADWEIGHT_RUN_ID come from the test.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import deadweight
from tests.support import loops


def main(mode: str) -> None:
    dist.init_process_group("gloo")
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
