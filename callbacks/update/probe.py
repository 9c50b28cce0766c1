"""How far the watched tensors moved in one optimizer step, in one pass over memory.

``after_step`` reads the new weights and the snapshot, computes every figure of the step per
tensor (squared update, squared weights, changed or not, non-finite, elements whose bytes did
not change) and leaves the snapshot holding the new weights, so it is fresh for the next step.
``before_step`` (at ``on_pre_optimizer_step``) copies only when something wrote the weights
since that refresh: the tensors' version counters, bumped by every in-place write (optimizers,
``copy_``, ``load_state_dict``), tell it. Writes through ``.data`` bypass the counters; such a
write between two steps is counted in the next step's update.

Three kernels compute the same figures; ``path="auto"`` takes the fastest one for the device:
``native`` (CPU, the default there) is the C loop built at install time, one pass over memory;
``torch`` is eager torch: on CPU over cache-sized chunks with a double-buffered snapshot, on an
accelerator ``torch._foreach_*`` ops whose figures go to pinned host memory with a
non-blocking copy, read later off the training thread (``after_step_deferred``). On the CPU
the kernel runs on the probe's own thread from the end of one optimizer step until the next
``before_step``, which waits for it: the training thread only hands it over. "Unchanged"
is exact, never a norm (a square underflows): the CPU kernels compare bytes, the accelerator
kernel counts elements with a nonzero difference, so there +0.0 and -0.0 count as equal. A
tensor holding a non-finite value is counted as non-finite, never as unchanged.

Sampled mode (full fine-tuning, above ``max_full_elements``): each tensor contributes a fixed
sample of ``sample_per_tensor`` elements in evenly spaced contiguous runs, so the snapshot
stays small whatever the model size. Figures then cover the sample (``UpdateStats.sampled``):
"unchanged" means the sampled elements kept their bytes. On CUDA the sample views are not
dense, so the multi-tensor ops fall back to one launch per tensor there.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch

from . import native as update_native
from .chunked import ChunkedKernel
from .device import DeviceKernel
from .kernel import CHANGED, NONFINITE, SAME_ELEMENTS, UPDATE_SQ, WEIGHT_SQ
from .native import NativeKernel, native_kernel
from .stats import Background, GroupStats, PendingStats, TensorGroup, UpdateStats

log = logging.getLogger("deadweight")

#: Above this many watched elements, a fixed sample per tensor replaces the full copy.
DEFAULT_MAX_FULL_ELEMENTS = 200_000_000
#: Elements kept per tensor in sampled mode.
DEFAULT_SAMPLE_PER_TENSOR = 4096

Path = Literal["auto", "native", "torch"]
_version = operator.attrgetter("_version")
#: The C method itself: mapped over the tensors every step, it costs a quarter of a
#: ``methodcaller`` (no attribute lookup per tensor). The watched tensors are parameters or
#: their local shards, none of which overrides ``data_ptr`` in Python.
_data_ptr = torch.Tensor.data_ptr



#: Set to "device" (tests, benchmarks): CPU tensors take the accelerator's path (the device
#: kernel queued on the training thread, figures copied without blocking and read later by the
#: sender), so a CPU test runs the code a GPU runs and can count its host reads.
PATH_ENV = "DEADWEIGHT_UPDATE_PATH"


def device_path_forced() -> bool:
    """Whether ``PATH_ENV`` asks for the device path on CPU tensors."""
    return os.environ.get(PATH_ENV, "") == "device"


def _sample_runs(sample: int) -> int:
    """How many runs a sample is cut into: its largest divisor up to 64, or single elements
    when it has no divisor of 8 or more (a prime, say)."""
    best = max(d for d in range(1, min(64, sample) + 1) if sample % d == 0)
    return best if best >= 8 else sample



def _leading(tensor: torch.Tensor, length: int | None) -> torch.Tensor:
    """The first ``length`` elements of a 1-D tensor, as a view (the whole of any other)."""
    if length is None or tensor.dim() != 1 or length >= tensor.numel():
        return tensor
    return tensor.narrow(0, 0, length)


class UpdateProbe:
    """Snapshot the watched tensors before a step and measure the update after it."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        groups: Sequence[TensorGroup] = (),
        max_full_elements: int = DEFAULT_MAX_FULL_ELEMENTS,
        sample_per_tensor: int = DEFAULT_SAMPLE_PER_TENSOR,
        path: Path = "auto",
        background: bool = True,
        lengths: Sequence[int | None] = (),
    ) -> None:
        #: Per tensor, how many leading elements are weights (None: all; a ZeRO-3 partition
        #: ends in an uninitialised pad, which is never read).
        self._lengths = list(lengths) or [None] * len(tensors)
        self.watched_params = sum(t.numel() if n is None else n
                                  for t, n in zip(tensors, self._lengths, strict=True))
        self._background = background
        self._worker: ThreadPoolExecutor | None = None
        self._inflight: Future[tuple[UpdateStats, list[int]]] | None = None
        self.sampled = self.watched_params > max_full_elements
        self._tensors = list(tensors)
        self._sample = sample_per_tensor
        self._path = path
        self._groups = list(groups)
        self._ready = False
        self._group_index = self._build_group_index(len(self._tensors))
        self._bind()
        # the CPU torch fallback is several times slower than the installed kernel: say so
        slow = (self.path == "torch" and path == "auto" and bool(self._sources)
                and all(s.device.type == "cpu" for s in self._sources)
                and not device_path_forced())
        log.log(logging.WARNING if slow else logging.INFO,
                "deadweight: update pass runs the %s kernel on %d tensors", self.describe(),
                len(self._tensors))

    def describe(self) -> str:
        """Which kernel runs, and why (the one log line at start)."""
        if self.path == "native":
            return update_native.describe()
        devices = sorted({t.device.type for t in self._sources})
        if devices and devices != ["cpu"]:
            return f"torch (tensors on {','.join(devices)}: device kernel, deferred read)"
        if isinstance(self._kernel, DeviceKernel):
            return f"torch (device kernel on the CPU, deferred read: {PATH_ENV}=device)"
        if self._path == "torch":
            return "torch (asked for)"
        return update_native.describe() if update_native.load() is None else (
            "torch (dtype or layout outside the native kernel)")

    def _bind(self) -> None:
        """Alias the tensors' current storage and lay out the snapshot and the kernel.

        Runs again if a tensor's storage is replaced (``param.data = ...``, a device move):
        the old aliases would otherwise keep measuring memory the model no longer uses.
        """
        self._storage = list(map(_data_ptr, self._tensors))
        self._sources = [self._view(_leading(t.detach(), n), self._sample)
                         for t, n in zip(self._tensors, self._lengths, strict=True)]
        self._valid_at: list[int] | None = None  # versions at which snapshot == weights
        self._elements = torch.tensor([float(s.numel()) for s in self._sources],
                                      dtype=torch.float64)
        forced = device_path_forced()
        native = None if self._path == "torch" or forced else native_kernel(self._sources)
        if self._path == "native" and native is None:
            raise RuntimeError("the native update kernel is unavailable for these tensors")
        kernel: NativeKernel | ChunkedKernel | DeviceKernel
        if native is not None:
            kernel = native
        elif all(s.device.type == "cpu" for s in self._sources) and not forced:
            kernel = ChunkedKernel(self._sources)
        else:
            kernel = DeviceKernel(self._sources)
        self._kernel = kernel
        self.path: str = "native" if native is not None else "torch"
        #: CPU kernels run on the probe's own thread (see ``after_step_deferred``); the device
        #: kernel only queues work, so it stays on the training thread.
        self.in_background = self._background and not isinstance(kernel, DeviceKernel)
        self._group_dtypes = [
            ",".join(sorted({str(self._sources[i].dtype).removeprefix("torch.")
                             for i in g.indices})) for g in self._groups
        ]

    @property
    def _snapshot(self) -> list[torch.Tensor]:
        """The snapshot views, in source order (for tests and tools)."""
        return self._kernel.snapshot

    @property
    def snapshot_bytes(self) -> int:
        """Memory held by the snapshot."""
        return self._kernel.snapshot_bytes

    def _view(self, tensor: torch.Tensor, sample: int) -> torch.Tensor:
        """The whole tensor, or in sampled mode a fixed sample of exactly ``sample`` elements.

        The sample is evenly spaced contiguous runs (a view, no copy): reading 4096 scattered
        elements costs a cache line and often a page walk each, runs of 64 cost one per run.
        """
        n = tensor.numel()
        if not self.sampled or n <= sample or not tensor.is_contiguous():
            return tensor
        runs = _sample_runs(sample)
        length = sample // runs
        gap = (n - length) // max(runs - 1, 1)
        return tensor.view(-1).as_strided((runs, length), (gap, 1))

    def _build_group_index(self, n: int) -> torch.Tensor:
        """A (1 + groups) x tensors 0/1 matrix: row 0 is every tensor, then one row per group,
        so totals and group sums come from one matmul, not a Python loop."""
        index = torch.zeros(1 + len(self._groups), n, dtype=torch.float64)
        index[0] = 1.0
        for row, group in enumerate(self._groups, start=1):
            index[row, group.indices] = 1.0
        self._group_sizes = [int(c) for c in index.sum(dim=1).tolist()[1:]]
        return index

    def before_step(self) -> None:
        """Make sure the snapshot holds the weights (called at on_pre_optimizer_step).

        After a measured step the snapshot is already fresh; it is copied again only when a
        version counter shows that something wrote a watched tensor since.
        """
        self._settle()
        tensors = self._tensors
        if list(map(_data_ptr, tensors)) != self._storage:
            self._bind()
        # The versions are read off the watched tensors, not the sources: a source is their
        # detached alias or a view of it, which shares its version counter, and the tensors
        # are the objects the line above just brought into the cache.
        if self._sources and self._valid_at != list(map(_version, tensors)):
            with torch.no_grad():
                self._kernel.refresh()
            self._valid_at = list(map(_version, tensors))
        self._ready = True

    def after_step(self) -> UpdateStats | None:
        """Measure the update since before_step and read it now; None if no snapshot was taken.

        On an accelerator this waits for the device; the callback uses ``after_step_deferred``.
        """
        pending = self.after_step_deferred()
        return None if pending is None else pending.result()

    def after_step_deferred(self) -> PendingStats | None:
        """Queue the measurement of the update since before_step; None without a snapshot.

        The training thread only launches the work; ``result()`` on the returned object
        reads the figures (later, and from another thread: the callback's sender). On the
        CPU the kernel itself runs on the probe's own thread (``in_background``): the weights
        stay as they are until the next optimizer step, and ``before_step`` waits for it.
        """
        if not self._ready:
            return None
        self._ready = False
        if not self._sources:
            empty = UpdateStats(0.0, 0.0, 0, 0, 0, 0, self.sampled, [])
            return PendingStats(lambda: empty, [])
        self._valid_at = None  # a kernel that fails midway leaves no trusted snapshot
        if self.in_background:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="deadweight-update")
            job = self._worker.submit(self._run_kernel)
            self._inflight = job
            return PendingStats(lambda: job.result()[0], [Background(job)])
        figures, fences = self._kernel.run()  # also refreshes the snapshot
        self._valid_at = list(map(_version, self._tensors))  # (shared with the sources)
        return PendingStats(lambda: self._summarise(figures()), fences)

    def _run_kernel(self) -> tuple[UpdateStats, list[int]]:
        """The CPU kernel and the summary, on the probe's thread (grad mode is per thread),
        and the versions of the weights it read (nothing but the optimizer writes them in
        between, and only after ``_settle``; a write during the pass shows as a newer version
        there)."""
        versions = list(map(_version, self._tensors))
        with torch.no_grad():
            figures = self._kernel.run()[0]
        return self._summarise(figures()), versions

    def _settle(self) -> None:
        """Wait for the background kernel of the last step: the optimizer must not write the
        weights while it reads them, nor ``before_step`` refresh a snapshot it is writing.

        It has had a whole forward and backward pass to finish, so this rarely waits.
        """
        job, self._inflight = self._inflight, None
        if job is None:
            return
        try:
            self._valid_at = job.result()[1]
        except Exception:  # the reader of its figures logs it; the snapshot is not trusted
            self._valid_at = None

    def close(self) -> None:
        """Let the background kernel finish and release its thread (at the run's end)."""
        self._settle()
        if self._worker is not None:
            self._worker.shutdown(wait=True)  # idle once settled: it exits at once
            self._worker = None

    def _summarise(self, figures: torch.Tensor) -> UpdateStats:
        """Totals and group sums from the per-tensor figures (already on the host)."""
        nonfinite = figures[:, NONFINITE] != 0
        columns = torch.stack([
            # update sq of finite tensors only (a NaN would poison every row of the matmul)
            torch.where(nonfinite | ~torch.isfinite(figures[:, UPDATE_SQ]), 0.0,
                        figures[:, UPDATE_SQ]),
            figures[:, WEIGHT_SQ],
            ((figures[:, CHANGED] == 0) & ~nonfinite).double(),  # unchanged
            nonfinite.double(),
            figures[:, SAME_ELEMENTS],
            self._elements,
        ], dim=1)
        sums = (self._group_index @ columns).tolist()
        total = sums[0]
        groups = [
            GroupStats(g.name, g.kind, row[0], size, int(row[2]), elements=int(row[5]),
                       unchanged_elements=int(row[4]), dtype=dtype)
            for g, row, size, dtype in zip(self._groups, sums[1:], self._group_sizes,
                                           self._group_dtypes, strict=True)
        ]
        return UpdateStats(
            update_sq_sum=total[0],
            param_sq_sum=total[1],
            watched_tensors=len(self._sources),
            watched_params=self.watched_params,
            unchanged_tensors=int(total[2]),
            nonfinite_update_tensors=int(total[3]),
            sampled=self.sampled,
            groups=groups,
            unchanged_elements=int(total[4]),
        )
