"""The multi-rank stop agreement's per-step cost: 2 ranks, gloo, loopback.

Each rank runs the callback's real ``StopAgreement`` (a non-blocking MAX all-reduce at each
agreement point, the previous one's result read; short steps share one point) around a
simulated data-parallel training step (fixed compute, then a gradient all-reduce that keeps
the ranks in step, as DDP does), and times ``step_end``: its mean over all steps is the cost
per step. Reference: a blocking all-reduce of the same flag at every step, what an agreement
that waited for the other rank would cost.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

from deadweight.demo.sidecar_process import free_port

from .common import fmt_time, table, verdict

#: The agreement's share of a training step (the callback's whole budget is 0.25%).
STEP_SHARE_BUDGET = 0.0025


def _step_work(size: int, grads: Any) -> None:
    """A fixed amount of single-thread compute standing in for forward/backward, then the
    gradient all-reduce that keeps data-parallel ranks in step (as DDP does)."""
    import torch
    import torch.distributed as dist

    a = torch.ones(size, size)
    for _ in range(4):
        a = a @ a
        a.div_(float(a.max()))
    dist.all_reduce(grads)


def _rank(rank: int, port: int, steps: int, size: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from deadweight.callbacks.stop_agreement import StopAgreement

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        agreement = StopAgreement.create()
        assert agreement is not None
        agreed_at = -1
        agree, blocking, work, at_points = [], [], [], []
        flag = torch.zeros(1, dtype=torch.int32)
        grads = torch.zeros(1 << 16)
        for step in range(steps):
            t0 = time.perf_counter()
            _step_work(size, grads)
            t1 = time.perf_counter()
            before = agreement.agreements
            # rank 1 proposes halfway: both must agree on the same later step
            agreed = agreement.step_end(rank == 1 and step == steps // 2)
            work.append(t1 - t0)
            agree.append(time.perf_counter() - t1)
            if agreement.agreements > before and step:
                at_points.append(agree[-1])
            if agreed and agreed_at < 0:
                agreed_at = step
        points = agreement.agreements
        for _ in range(steps):  # the reference, in its own phase
            _step_work(size, grads)
            t0 = time.perf_counter()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            blocking.append(time.perf_counter() - t0)
        agreement.close()
        if rank == 0:
            out.put((agree[1:], blocking[1:], work[1:], agreed_at, points, at_points))
    finally:
        dist.destroy_process_group()


Measured = tuple[list[float], list[float], list[float], int, int, list[float]]


def measure(steps: int, size: int = 640) -> Measured:
    """Per-step seconds on rank 0: agreement, blocking all-reduce, step work; agreed step;
    all-reduces the agreement started; seconds of the step ends that started one."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, steps, size, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result: Measured = out.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return result


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(repeats: int, quick: bool) -> list[list[str]]:
    """The agreement's mean cost per step, its cost at a point, the blocking reference, and
    how many steps after a proposal every rank stopped."""
    from deadweight.callbacks.stop_agreement import INTERVAL_SECONDS, MAX_STEPS_PER_AGREEMENT

    steps = 80 if quick else 300
    agree, blocking, work, agreed_at, points, at_points = measure(steps)
    step = statistics.median(work)
    mean = statistics.fmean(agree)
    proposed = steps // 2
    late = agreed_at - proposed
    rows = [
        ["simulated step (compute + gradient all-reduce)", fmt_time(step), "", "",
         "reference"],
        [f"StopAgreement.step_end per step (mean; {points} all-reduces in {steps} steps)",
         fmt_time(mean), fmt_time(_pct(agree, 0.99)), f"{mean / step:.3%}",
         f"<= {STEP_SHARE_BUDGET:.2%} of a step {verdict(mean / step <= STEP_SHARE_BUDGET)}"],
        ["  a step end that starts an all-reduce (median)",
         fmt_time(statistics.median(at_points)) if at_points else "-",
         fmt_time(_pct(at_points, 0.99)) if at_points else "-", "", ""],
        ["blocking all_reduce of the same flag at every step",
         fmt_time(statistics.median(blocking)), fmt_time(_pct(blocking, 0.99)),
         f"{statistics.median(blocking) / step:.3%}", "reference"],
        [f"every rank stopped after step {agreed_at} (proposed at {proposed})",
         f"{late} steps", fmt_time(late * step), "",
         f"same step, within 2 x {INTERVAL_SECONDS} s / {2 * MAX_STEPS_PER_AGREEMENT} steps "
         + verdict(0 < late <= 2 * MAX_STEPS_PER_AGREEMENT)],
    ]
    table(f"multi-rank stop agreement (2 ranks, gloo, loopback, {steps} steps, rank 0)",
          ["what", "median", "p99", "of step", "budget"], rows)
    return rows
