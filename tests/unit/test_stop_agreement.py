"""The stop agreement on two real gloo ranks (loopback): every rank stops after the same
step; short steps share one all-reduce, long ones agree at every step end."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from deadweight.callbacks.stop_agreement import MAX_STEPS_PER_AGREEMENT
from deadweight.demo.sidecar_process import free_port


def _rank(rank: int, port: int, propose_at: int, interval: float, step_seconds: float,
          out: Any) -> None:
    import torch.distributed as dist

    from deadweight.callbacks.stop_agreement import StopAgreement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        agreement = StopAgreement(dist.new_group(backend="gloo"), interval_seconds=interval)
        stopped_at = -1
        for step in range(1, 2001):
            if step_seconds:
                time.sleep(step_seconds)  # the step itself: its length is what is tested
            if agreement.step_end(rank == 1 and step == propose_at):
                stopped_at = step
                break
        agreement.close()
        out.put((rank, stopped_at, agreement.agreements))
    finally:
        dist.destroy_process_group()


def _run(propose_at: int, interval: float, step_seconds: float) -> dict[int, tuple[int, int]]:
    """{rank: (step it stopped after, all-reduces it started)}"""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, propose_at, interval, step_seconds, out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return {rank: (stopped, count) for rank, stopped, count in results}


def test_short_steps_share_an_all_reduce_and_every_rank_stops_after_the_same_step() -> None:
    result = _run(propose_at=50, interval=0.25, step_seconds=0.0)
    (stop0, count0), (stop1, count1) = result[0], result[1]
    assert stop0 == stop1, result
    assert 50 < stop0 <= 50 + 2 * MAX_STEPS_PER_AGREEMENT
    assert count0 == count1
    assert count0 <= stop0 // 4  # one all-reduce per step would be stop0 of them


def test_long_steps_agree_at_every_step_end_one_step_after_the_proposal() -> None:
    result = _run(propose_at=5, interval=0.01, step_seconds=0.02)
    assert result == {0: (6, 6), 1: (6, 6)}
