"""The per-step update-norm pass against the memory-bandwidth bound.

Bound = 3 x adapter bytes / copy bandwidth (read the weights, read the snapshot, write the
snapshot). The torch path's ops, timed again on data already in the cache, give its compute
alone: one thread runs eager ops one after another, so that time adds to the memory time and
bound + compute is the path's floor. Both probe paths also count the elements whose bytes did
not change (per module kind on the wire); "eager foreach" does not, "eager foreach + count"
does, the eager way.
Each variant is timed as before_step + after_step around a simulated optimizer step
(untimed), with the caches flushed first, as a forward/backward pass would leave them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from deadweight.callbacks.update.chunked import ChunkedKernel
from deadweight.callbacks.update.probe import UpdateProbe
from deadweight.callbacks.update.stats import PendingStats

from .common import Timing, flush_cache, fmt_time, table, verdict
from .shapes import ALL, QWEN3_06B_R16, ModelShape, make_adapter

BUDGET = 1.5  # x the bandwidth bound


class NaiveLoop:
    """Reference: a per-tensor Python loop (copy before, subtract and sum after)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.snapshot = [torch.empty_like(t) for t in tensors]

    def before_step(self) -> None:
        for snap, t in zip(self.snapshot, self.tensors, strict=True):
            snap.copy_(t)

    def after_step(self) -> list[list[float]]:
        rows = []
        for snap, t in zip(self.snapshot, self.tensors, strict=True):
            d = t.float() - snap.float()
            rows.append(torch.stack([d.square().sum(), t.float().square().sum()]))
        return torch.stack(rows).tolist()


class EagerForeach:
    """Reference: eager torch._foreach_* ops (copy before; subtract and two norms after)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.snapshot = [torch.empty_like(t) for t in tensors]

    def before_step(self) -> None:
        torch._foreach_copy_(self.snapshot, self.tensors)

    def after_step(self) -> list[list[float]]:
        torch._foreach_sub_(self.snapshot, self.tensors)
        upd = torch._foreach_norm(self.snapshot)
        par = torch._foreach_norm(self.tensors)
        return torch.stack([torch.stack(upd).double(), torch.stack(par).double()]).tolist()


class EagerForeachCount(EagerForeach):
    """Reference: eager foreach computing what the probe computes, the changed-element count
    too (sign of the difference, then its 1-norm), without the probe's chunking."""

    def after_step(self) -> list[list[float]]:
        torch._foreach_sub_(self.snapshot, self.tensors)
        upd = torch._foreach_norm(self.snapshot)
        par = torch._foreach_norm(self.tensors)
        torch._foreach_sign_(self.snapshot)
        moved = torch._foreach_norm(self.snapshot, 1)
        return torch.stack([torch.stack(upd).double(), torch.stack(par).double(),
                            torch.stack(moved).double()]).tolist()


Variant = NaiveLoop | EagerForeach | UpdateProbe


def _step(tensors: list[torch.Tensor]) -> None:
    """The simulated optimizer step: every weight moves."""
    torch._foreach_add_(tensors, 1e-4)


def _timed(fn: Callable[[], object]) -> float:
    """Seconds of one call, after a cache flush."""
    flush_cache()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(variants: dict[str, Variant], tensors: list[torch.Tensor], nbytes: int,
                repeats: int) -> tuple[dict[str, Timing], Timing]:
    """Per round: every before_step, one optimizer step, every after_step, one same-size copy.

    All variants see the same step and the same load spikes; caches are flushed before each
    timed call. Seconds are before_step + after_step; the optimizer step is not timed.
    """
    src = torch.ones(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    times: dict[str, list[float]] = {name: [] for name in variants}
    copies: list[float] = []
    for round_ in range(repeats + 1):
        pre = {name: _timed(v.before_step) for name, v in variants.items()}
        _step(tensors)
        for name, variant in variants.items():
            if round_:  # round 0 fills the snapshots
                times[name].append(pre[name] + _timed(variant.after_step))
            else:
                variant.after_step()
        copies.append(_timed(lambda: dst.copy_(src)))
    result = {k: Timing(min(v), statistics.median(v)) for k, v in times.items()}
    return result, Timing(min(copies), statistics.median(copies))


def compute_only(probe: UpdateProbe, repeats: int) -> float:
    """Seconds of the CPU torch kernel's ops with every chunk already in the L2 cache (each
    chunk's ops run twice, the second run timed): the part of its time that no memory system
    removes. Eager ops run one after another on one thread, so this adds to the memory time
    instead of hiding behind it."""
    kernel = probe._kernel
    assert isinstance(kernel, ChunkedKernel)
    best = math.inf
    for _ in range(repeats):
        total = 0.0
        for part in kernel._parts:
            for chunk in part.next_chunks:
                part.measure(chunk)
                start = time.perf_counter()
                part.measure(chunk)
                total += time.perf_counter() - start
        best = min(best, total)
    return best


def run(bandwidth: float, repeats: int, quick: bool) -> list[list[str]]:
    """One row per (shape, dtype, variant)."""
    rows: list[list[str]] = []
    shapes: list[ModelShape] = [QWEN3_06B_R16] if quick else ALL
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            tensors = make_adapter(shape, dtype)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            variants: dict[str, Variant] = {
                "naive loop": NaiveLoop(tensors),
                "eager foreach": EagerForeach(tensors),
                "eager foreach + count": EagerForeachCount(tensors),
                "probe torch": UpdateProbe(tensors, path="torch", background=False),
                "probe native": UpdateProbe(tensors, path="native", background=False),
            }
            timings, copy = interleaved(variants, tensors, nbytes, repeats)
            # bandwidth from the copy timed in the same rounds, so load hits both alike
            bw = 2 * nbytes / copy.best
            bound = 3 * nbytes / bw
            eager = timings["eager foreach"].best
            for name, timing in timings.items():
                ratio = timing.best / bound
                budget = "reference"
                if name == "probe torch":  # the bound, or at least never slower than eager
                    budget = (f"<= {BUDGET}x {verdict(ratio <= BUDGET)}, "
                              f"{timing.best / eager:.2f}x eager foreach "
                              f"{verdict(timing.best <= eager)}")
                elif name.startswith("probe"):
                    budget = f"<= {BUDGET}x " + verdict(ratio <= BUDGET)
                rows.append([
                    shape.name, str(dtype).removeprefix("torch."), f"{nbytes / 2**20:.0f} MiB",
                    name, fmt_time(timing.best), fmt_time(timing.median), fmt_time(bound),
                    f"{ratio:.2f}x", f"{timing.median / bound:.2f}x", budget,
                ])
            hot = compute_only(variants["probe torch"], repeats)  # type: ignore[arg-type]
            rows.append([
                shape.name, str(dtype).removeprefix("torch."), f"{nbytes / 2**20:.0f} MiB",
                "probe torch ops, data in cache", fmt_time(hot), "", fmt_time(bound),
                f"{hot / bound:.2f}x", "",
                f"reference: compute alone; eager ops run one after another, so the torch "
                f"path's floor is bound + this = {1 + hot / bound:.2f}x",
            ])
            del tensors, variants
    table("update-norm pass (before_step + after_step) vs bandwidth bound "
          "(bound = 3 x bytes / copy bandwidth)",
          ["adapter", "dtype", "size", "variant", "best", "median", "bound", "ratio",
           "median ratio", "budget"], rows)
    return rows


def _count_syncs(fn: Callable[[], object]) -> tuple[object, int]:
    """Run fn with CUDA's sync debug mode on; the synchronizing calls it made on this thread."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message).lower() for w in caught)


def run_device(device: str, repeats: int, quick: bool) -> list[list[str]]:
    """The update pass on an accelerator: the training thread's cost (launch only, the
    figures are read one step later), the device time, and the syncs it forced.

    Bound = 3 x adapter bytes / the device's copy bandwidth (a same-size copy timed with
    events). Eager foreach (which reads its norms at once, a sync) is the reference.
    """
    dev = torch.device(device)
    rows: list[list[str]] = []
    shapes: list[ModelShape] = [QWEN3_06B_R16] if quick else ALL
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            tensors = [t.to(dev) for t in make_adapter(shape, dtype)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            src = torch.ones(max(nbytes // 4, 1), device=dev)
            dst = torch.empty_like(src)
            probe = UpdateProbe(tensors, path="torch", background=False)
            eager = EagerForeach(tensors)
            host: dict[str, list[float]] = {"probe": [], "eager": []}
            gpu: dict[str, list[float]] = {"probe": [], "eager": [], "copy": []}
            syncs = {"probe": 0, "eager": 0}
            for _ in range(repeats):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                torch.cuda.synchronize()
                begin.record()
                dst.copy_(src)
                end.record()
                torch.cuda.synchronize()
                gpu["copy"].append(begin.elapsed_time(end) / 1e3)
            # each variant in its own phase, so neither sees the other's writes (steady state)
            for name, variant in (("probe", probe), ("eager", eager)):
                pending: PendingStats | None = None
                for round_ in range(repeats + 1):
                    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    events[0].record()
                    _, n_before = _count_syncs(variant.before_step)
                    events[1].record()
                    t1 = time.perf_counter()
                    _step(tensors)  # the optimizer step, not timed
                    previous = pending
                    t2 = time.perf_counter()
                    events[2].record()
                    if isinstance(variant, UpdateProbe):
                        pending, n_after = _count_syncs(
                            variant.after_step_deferred)  # type: ignore[assignment]
                    else:
                        _, n_after = _count_syncs(variant.after_step)
                    events[3].record()
                    t3 = time.perf_counter()
                    if previous is not None:
                        previous.result()  # last step's figures (the sender thread's job)
                    torch.cuda.synchronize()
                    if round_:  # round 0 fills the snapshot
                        host[name].append((t1 - t0) + (t3 - t2))
                        gpu[name].append((events[0].elapsed_time(events[1])
                                          + events[2].elapsed_time(events[3])) / 1e3)
                        syncs[name] += n_before + n_after
            bound = 3 * nbytes / (2 * nbytes / min(gpu["copy"]))
            for name in ("probe", "eager"):
                rows.append([
                    shape.name, str(dtype).removeprefix("torch."), f"{nbytes / 2**20:.0f} MiB",
                    "probe torch (deferred read)" if name == "probe" else "eager foreach",
                    fmt_time(statistics.median(host[name])),
                    fmt_time(min(gpu[name])), fmt_time(bound),
                    f"{min(gpu[name]) / bound:.2f}x",
                    f"{syncs[name] / repeats:.1f}",
                    (f"<= {BUDGET}x, 0 syncs: "
                     + verdict(min(gpu[name]) / bound <= BUDGET and syncs[name] == 0))
                    if name == "probe" else "reference",
                ])
            del tensors, probe, eager, src, dst
    table(f"update pass on {device}: training-thread time, device time, syncs per step "
          "(bound = 3 x bytes / device copy bandwidth)",
          ["adapter", "dtype", "size", "variant", "thread (median)", "device (best)", "bound",
           "ratio", "syncs/step", "budget"], rows)
    return rows
