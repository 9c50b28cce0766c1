"""A raw PyTorch loop under ``deadweight.watch`` that never reads ``monitor.should_stop``.

Usage: ``python tests/support/deaf_loop_worker.py MODE ADDRESS RUN_ID STEPS``. MODE is
``frozen`` (the optimizer holds none of the model's parameters: gradients flow, nothing
moves) or ``healthy``. The loop goes on after a STOP, the way a script that forgot the flag
does, so under a ``kill`` policy only the sidecar's signals end it. stderr carries the
console (Python logging, as a script that calls ``logging.basicConfig`` shows it) with a
``worker: step N`` line after each step; ``LOOP_ENDED step=N`` when the loop finishes.
"""

from __future__ import annotations

import logging
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The loop's pace: leave CPU to the rest of the machine (not a wait on a condition).
PAUSE_SECONDS = 0.02


def main(mode: str, address: str, run_id: str, steps: int) -> None:
    import torch

    import deadweight
    from tests.support import raw_loop_worker

    logging.basicConfig(stream=sys.stderr, format="%(message)s")
    torch.set_num_threads(1)
    model = raw_loop_worker._net()
    params = [torch.nn.Parameter(torch.zeros(1))] if mode == "frozen" else model.parameters()
    optimizer = torch.optim.AdamW(params, lr=raw_loop_worker.LR)
    with deadweight.watch(model, optimizer, run_id=run_id, address=address,
                          start_timeout_seconds=10.0) as monitor:
        for step in range(1, steps + 1):
            raw_loop_worker.plain_step(model, optimizer, monitor, step)
            print(f"worker: step {step}", file=sys.stderr, flush=True)
            time.sleep(PAUSE_SECONDS)
    print(f"LOOP_ENDED step={steps}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
