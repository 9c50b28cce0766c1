"""What the per-rank phase marks cost a training step (``callbacks/progress.py``).

On runs of several ranks the client marks, per step, a forward pass begun and ended (hooks on
the outer model), the backward begun (a gradient hook on a few trainable parameters) and ended
(a callback the autograd engine runs at its end) and the optimizer step. The same training
step of a Qwen3-0.6B-shaped LoRA r16 model runs with the marks and without, in interleaved
blocks; beside the ratio of the medians (the noise of a difference is printed with it), the
hooks' own work is timed directly, one step's worth of calls repeated.
"""

from __future__ import annotations

import statistics
import time

import torch

from deadweight.callbacks.progress import BACKWARD_MARK_PARAMS, StepProgress
from deadweight.callbacks.stream_client import StreamClient
from deadweight.proto import pb

from .common import fmt_time, table


def _client() -> StreamClient:
    """A client that is never started: the hooks only write its marks."""
    def to_event(kind: str, record: object) -> pb.Event:
        return pb.Event()

    return StreamClient("unix:///nonexistent.sock", "bench-marks", 0, to_event)


def _direct_cost(model: torch.nn.Module, repeats: int) -> float:
    """Seconds of one step's hook calls (forward pre and post, the backward's first gradient
    and its end, the optimizer step's mark), called directly ``repeats`` times."""
    client = _client()
    marks = StepProgress(client, model)
    param = next(p for p in model.parameters() if p.requires_grad)
    pre, post, grad = marks._pre, marks._post, marks._grad_ready
    queue, marks._queue = marks._queue, None  # no backward runs here to take the callback
    done = marks._backward_done
    try:
        start = time.perf_counter()
        for step in range(1, repeats + 1):
            pre(model, ())
            post(model, (), None)
            for _ in range(BACKWARD_MARK_PARAMS):
                grad(param)
            done()
            marks.step_done(step)
        return (time.perf_counter() - start) / repeats
    finally:
        marks._queue = queue
        marks.close()


def run(repeats: int, quick: bool, device: str = "cpu") -> list[list[str]]:
    """Training steps with and without the marks, interleaved; the hooks' direct cost."""
    from .train_step import SEQ, build_model

    layers = 4 if quick else 28
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    model = build_model(layers).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    tokens = torch.randint(0, 151_936, (1, SEQ), device=dev)
    client = _client()

    def step() -> float:
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up
    blocks = 2 if quick else max(3, repeats)
    per_block = 2 if quick else 3
    times: dict[bool, list[float]] = {False: [], True: []}
    seen: list[int] = []
    for i in range(blocks):
        for marked in ((False, True) if i % 2 == 0 else (True, False)):
            marks = StepProgress(client, model) if marked else None
            for n in range(per_block):
                times[marked].append(step())
                if marks is not None:
                    marks.step_done(n + 1)
                    seen.append(client.phase)
            if marks is not None:
                marks.close()
    without, with_marks = statistics.median(times[False]), statistics.median(times[True])
    noise = statistics.median(times[False]) - min(times[False])
    direct = _direct_cost(model, 20_000)
    rows = [
        ["training step without marks (median)", fmt_time(without), "", ""],
        ["training step with marks (median)", fmt_time(with_marks),
         f"{with_marks / without:.4f}x", f"noise (median - min without): {fmt_time(noise)}"],
        ["the marks' hook calls of one step, timed directly", fmt_time(direct),
         f"{direct / without:.4%} of a step", "reference: no device work, no tensor"],
    ]
    table(f"per-rank phase marks vs a training step (Qwen3-0.6B shape, {layers} layers, LoRA "
          f"r16, batch 1x{SEQ}, {device}, {blocks} blocks of {per_block} steps each way)",
          ["what", "time", "ratio", "note"], rows)
    assert seen and all(p == 4 for p in seen)  # the marks ran: the optimizer step's last
    return rows
