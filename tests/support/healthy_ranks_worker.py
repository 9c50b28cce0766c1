"""One rank of the healthy corpus's multi-rank loops, as users write them, under
``deadweight.watch``.

Usage: ``torchrun --nproc-per-node 2 tests/support/healthy_ranks_worker.py MODEL_DIR OUT_DIR LOOPS``
with ``DEADWEIGHT_ADDRESS`` set. LOOPS is a comma-separated list run one after the other in
this process (one process group, one import of the training stack), each its own run under
the id ``corpus-<loop>``:

- ``ddp-no-sync-accumulation``: the tiny causal LM trained whole under DDP, 4 micro-batches
  accumulated per optimizer step, the first 3 under ``no_sync()``;
- ``fsdp2-fully-shard``: the tiny LM sharded with ``fully_shard`` on each decoder layer and
  on the whole model, AdamW built after sharding, the grad norm clipped and logged;
- ``ddp-busy-machine``: the DDP loop (no accumulation) while a process beside it spins a CPU
  core for the whole run (rank 0 starts it and ends it).

Each rank writes ``OUT_DIR/<loop>/rank<N>.json``: the run id and the optimizer steps it took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 6
ACCUMULATION = 4
LOOPS = ("ddp-no-sync-accumulation", "fsdp2-fully-shard", "ddp-busy-machine")


def _batches(model_dir: Path, rank: int, count: int) -> list[dict[str, Any]]:
    """This rank's micro-batches of 2 rows of generated text (its own shard of the data)."""
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    from deadweight.demo.tiny_models import sample_lines

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    lines = sample_lines(2 * count, seed=30 + rank)
    return [collate([tokenizer(line) for line in lines[i:i + 2]])
            for i in range(0, len(lines), 2)]


@contextmanager
def _cpu_hog(rank: int) -> Iterator[None]:
    """A process spinning one core beside the run, started and ended by rank 0."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if rank == 0 else None
    try:
        yield
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def _ddp(model_dir: Path, rank: int, run_id: str, accumulation: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    import deadweight

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        AutoModelForCausalLM.from_pretrained(model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = _batches(model_dir, rank, STEPS * accumulation)
    with deadweight.watch(model, optimizer, run_id=run_id) as monitor:
        for step in range(1, STEPS + 1):
            window = batches[(step - 1) * accumulation:step * accumulation]
            for i, batch in enumerate(window, start=1):
                last = i == accumulation
                with model.no_sync() if not last else nullcontext():
                    loss = model(**batch).loss / accumulation
                    loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss * accumulation, grad_norm=grad_norm)
        return monitor.step


def _fsdp2(model_dir: Path, rank: int, run_id: str) -> int:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import deadweight

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with deadweight.watch(model, optimizer, run_id=run_id) as monitor:
        for step, batch in enumerate(_batches(model_dir, rank, STEPS), start=1):
            loss = model(**batch).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            grad_norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss, grad_norm=grad_norm)
        return monitor.step


def main(model_dir: Path, out: Path, loops: str) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for loop in loops.split(","):
        run_id = f"corpus-{loop}"
        if loop == "ddp-no-sync-accumulation":
            steps = _ddp(model_dir, rank, run_id, ACCUMULATION)
        elif loop == "fsdp2-fully-shard":
            steps = _fsdp2(model_dir, rank, run_id)
        elif loop == "ddp-busy-machine":
            with _cpu_hog(rank):
                steps = _ddp(model_dir, rank, run_id, 1)
        else:
            raise SystemExit(f"unknown loop {loop!r}: one of {', '.join(LOOPS)}")
        folder = out / loop
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.json").write_text(json.dumps({"run_id": run_id, "steps": steps}))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
