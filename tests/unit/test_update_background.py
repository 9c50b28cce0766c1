"""The CPU update kernel runs on the probe's own thread: the training thread hands it over,
``before_step`` waits for it before the optimizer writes, and a failure there is not trusted."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from deadweight.callbacks.update.probe import UpdateProbe

PATHS = ["native", "torch"]
_GATES: list[threading.Event] = []


@pytest.fixture(autouse=True)
def _open_gates() -> Iterator[None]:
    """A failed assertion must not leave a kernel held: its thread would block the exit."""
    yield
    for gate in _GATES:
        gate.set()
    _GATES.clear()


def _gate(probe: UpdateProbe, fail: bool = False) -> tuple[threading.Event, threading.Event,
                                                             list[int]]:
    """Hold the probe's kernel until ``go`` is set; ``finished`` is set as it returns; the
    ids of the threads it ran on are collected."""
    go, finished = threading.Event(), threading.Event()
    _GATES.append(go)
    threads: list[int] = []
    kernel = probe._kernel
    run = kernel.run

    def held() -> tuple[Callable[[], torch.Tensor], list[object]]:
        threads.append(threading.get_ident())
        go.wait()
        try:
            if fail:
                raise RuntimeError("kernel failed")
            return run()  # type: ignore[return-value]
        finally:
            finished.set()

    kernel.run = held  # type: ignore[method-assign,assignment]
    return go, finished, threads


@pytest.mark.parametrize("path", PATHS)
def test_the_training_thread_hands_the_kernel_over_without_waiting(path: str) -> None:
    t = torch.nn.Parameter(torch.ones(1000))
    probe = UpdateProbe([t], path=path)  # type: ignore[arg-type]
    assert probe.in_background
    go, finished, threads = _gate(probe)
    probe.before_step()
    with torch.no_grad():
        t.add_(0.5)
    pending = probe.after_step_deferred()  # returns while the kernel is still held
    assert pending is not None
    assert not finished.is_set()
    assert pending.peek() is None  # reading now would wait: the logger keys skip it
    go.set()
    stats = pending.result()
    assert threads and threads[0] != threading.get_ident()
    assert stats.update_sq_sum == pytest.approx(0.25 * 1000)
    assert stats.unchanged_tensors == 0
    assert pending.peek() is stats
    probe.close()
    assert not [th for th in threading.enumerate() if th.name.startswith("deadweight-update")]


@pytest.mark.parametrize("path", PATHS)
def test_before_step_waits_for_the_kernel_before_the_optimizer_writes(path: str) -> None:
    t = torch.nn.Parameter(torch.ones(1000))
    probe = UpdateProbe([t], path=path)  # type: ignore[arg-type]
    go, finished, _ = _gate(probe)
    probe.before_step()
    with torch.no_grad():
        t.add_(0.5)
    pending = probe.after_step_deferred()
    assert pending is not None
    seen: list[bool] = []
    caller = threading.Thread(target=lambda: (probe.before_step(),
                                              seen.append(finished.is_set())))
    caller.start()
    caller.join(timeout=0.5)  # a bound on a negative: it must not have returned meanwhile
    assert caller.is_alive(), "before_step returned while the kernel still read the weights"
    go.set()
    caller.join()
    assert seen == [True]
    with torch.no_grad():
        t.add_(0.25)  # the next optimizer step
    stats = probe.after_step()
    assert stats is not None and stats.update_sq_sum == pytest.approx(0.0625 * 1000)
    probe.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_kernel_that_failed_leaves_no_trusted_snapshot(path: str) -> None:
    t = torch.nn.Parameter(torch.ones(1000))
    probe = UpdateProbe([t], path=path)  # type: ignore[arg-type]
    go, _, _ = _gate(probe, fail=True)
    go.set()
    probe.before_step()
    with torch.no_grad():
        t.add_(1.0)
    pending = probe.after_step_deferred()
    assert pending is not None
    with pytest.raises(RuntimeError, match="kernel failed"):
        pending.result()
    probe._kernel.__dict__.pop("run")  # the kernel works again
    probe.before_step()  # copies the weights afresh: the failed pass refreshed nothing
    with torch.no_grad():
        t.add_(0.5)
    stats = probe.after_step()
    assert stats is not None and stats.update_sq_sum == pytest.approx(0.25 * 1000)
    probe.close()


def test_inline_and_background_give_the_same_figures_step_after_step() -> None:
    g = torch.Generator().manual_seed(3)
    a = [torch.nn.Parameter(torch.randn(64, 32, generator=g)) for _ in range(4)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    background, inline = UpdateProbe(a), UpdateProbe(b, background=False)
    assert background.in_background and not inline.in_background
    for step in range(5):
        moves = torch.randn(4, 64, 32, generator=g) * 10.0 ** -(step + 1)
        moves[step % 4] = 0.0  # one tensor stays put each step
        for probe, params in ((background, a), (inline, b)):
            probe.before_step()
            with torch.no_grad():
                for p, m in zip(params, moves, strict=True):
                    p.add_(m)
        got, want = background.after_step(), inline.after_step()
        assert got == want
        assert got is not None and got.unchanged_tensors == 1
    background.close()
