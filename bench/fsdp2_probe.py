"""The probe's per-step cost inside a real FSDP2 loop (``fully_shard``, 2 ranks, gloo, CPU).

``deadweight.watch`` measures each rank's local shards from the optimizer's step hooks. Its
cost per step is read from the hooks themselves: timing hooks registered before and after the
probe's own, so the figure is exactly the time spent in the probe's pre- and post-step hooks
(snapshot check, update pass over the local shards, record hand-off), next to the whole step
(forward, backward with its collectives, optimizer step). No sidecar runs: the record hand-off
is the same non-blocking append either way.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deadweight.demo.sidecar_process import free_port

from .common import fmt_time

#: Layers of width x width: 8 x 1024 x 1024 = 8.4M parameters, 4.2M per rank.
LAYERS, WIDTH, BATCH = 8, 1024, 8


def _worker(out: Path, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import deadweight

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    marks: dict[str, float] = {}

    def mark(name: str) -> object:
        def hook(*_: object) -> None:
            marks[name] = time.perf_counter()
        return hook

    optimizer.register_step_pre_hook(mark("pre_start"))
    optimizer.register_step_post_hook(mark("post_start"))
    monitor = deadweight.watch(model, optimizer, run_id="bench-fsdp2",
                               address=f"unix://{out}/absent.sock", start_timeout_seconds=0.0)
    optimizer.register_step_pre_hook(mark("pre_end"))
    optimizer.register_step_post_hook(mark("post_end"))
    x = torch.randn(BATCH, WIDTH)
    probe: list[float] = []
    whole: list[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        whole.append(time.perf_counter() - start)
        probe.append(marks["pre_end"] - marks["pre_start"]
                     + marks["post_end"] - marks["post_start"])
    local = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[attr-defined]
    path = monitor._run.update.path if monitor._run.update else "off"
    monitor.close()
    skip = min(2, steps - 1)  # the first steps build the snapshot and compile the kernel
    (out / f"rank{rank}.json").write_text(json.dumps({
        "local_params": local, "probe": probe[skip:], "step": whole[skip:],
        "path": path,
    }))
    dist.destroy_process_group()


def run(repeats: int, quick: bool) -> None:
    """Launch the 2-rank job and print the probe's cost per step per rank."""
    steps = 12 if quick else 4 * repeats
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "-m", "bench.fsdp2_probe", "--worker", str(out), str(steps)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            print(f"fsdp2_probe: the job failed:\n{done.stderr[-2000:]}")
            return
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(f"\n## fsdp2_probe: deadweight.watch under fully_shard, 2 ranks (gloo, CPU), "
          f"{LAYERS} x Linear({WIDTH}, {WIDTH}), AdamW, batch {BATCH}, {steps} steps")
    print("| rank | local params | kernel | probe per step (min / median) | step (median) "
          "| share |")
    print("|---|---|---|---|---|---|")
    for r, rank in enumerate(ranks):
        probe_med = statistics.median(rank["probe"])
        step_med = statistics.median(rank["step"])
        print(f"| {r} | {rank['local_params']:,} | {rank['path']} | "
              f"{fmt_time(min(rank['probe']))} / "
              f"{fmt_time(probe_med)} | {fmt_time(step_med)} | "
              f"{100 * probe_med / step_med:.2f}% |")




if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]), int(sys.argv[3]))
