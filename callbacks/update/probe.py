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

import ctypes
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from . import native as update_native

log = logging.getLogger("deadweight")

#: Above this many watched elements, a fixed sample per tensor replaces the full copy.
DEFAULT_MAX_FULL_ELEMENTS = 200_000_000
#: Elements kept per tensor in sampled mode.
DEFAULT_SAMPLE_PER_TENSOR = 4096
#: Byte alignment of each tensor's slot in the flat snapshot (a cache line).
_ALIGN = 64

Path = Literal["auto", "native", "torch"]
_version = operator.attrgetter("_version")
#: The C method itself: mapped over the tensors every step, it costs a quarter of a
#: ``methodcaller`` (no attribute lookup per tensor). The watched tensors are parameters or
#: their local shards, none of which overrides ``data_ptr`` in Python.
_data_ptr = torch.Tensor.data_ptr


@dataclass(frozen=True)
class GroupStats:
    """Summed figures for one group of tensors (an adapter, or a module kind)."""

    name: str
    kind: str
    update_sq_sum: float
    tensors: int
    unchanged_tensors: int
    #: Watched elements (sampled ones in sampled mode) and those whose bytes did not change.
    elements: int = 0
    unchanged_elements: int = 0
    #: The group's dtype(s), e.g. "bfloat16" or "bfloat16,float32".
    dtype: str = ""


@dataclass(frozen=True)
class UpdateStats:
    """What one optimizer step did to the watched tensors."""

    update_sq_sum: float
    param_sq_sum: float
    watched_tensors: int
    watched_params: int
    unchanged_tensors: int
    nonfinite_update_tensors: int
    sampled: bool
    groups: list[GroupStats] = field(default_factory=list)
    #: Watched elements whose bytes did not change (of the sample, in sampled mode).
    unchanged_elements: int = 0


@dataclass(frozen=True)
class TensorGroup:
    """A named set of indices into the watched tensor list."""

    name: str
    kind: str
    indices: list[int]


def _flat_snapshot(sources: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Contiguous snapshot views carved from one byte buffer per device."""
    offsets: list[int] = []
    sizes: dict[torch.device, int] = {}
    for src in sources:
        start = -(-sizes.get(src.device, 0) // _ALIGN) * _ALIGN
        offsets.append(start)
        sizes[src.device] = start + src.numel() * src.element_size()
    buffers = {dev: torch.empty(max(size, 1), dtype=torch.uint8, device=dev)
               for dev, size in sizes.items()}
    views = [
        buffers[src.device][off:off + src.numel() * src.element_size()]
        .view(src.dtype).view(src.shape)
        for src, off in zip(sources, offsets, strict=True)
    ]
    return list(buffers.values()), views


#: Columns of the per-tensor figures every kernel returns (float64, on the host).
UPDATE_SQ, WEIGHT_SQ, CHANGED, NONFINITE, SAME_ELEMENTS = range(update_native.FIGURES)
#: Bytes of source per chunk of the CPU torch kernel: its five ops over a chunk run in the L2
#: cache, so only the first read of each byte comes from memory.
CHUNK_BYTES = 256 * 1024


def _int_view(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same width, to compare bytes."""
    size = torch.empty(0, dtype=dtype).element_size()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def _wide(dtype: torch.dtype) -> torch.dtype | None:
    """Accumulation dtype for norms of 16-bit tensors (their own would keep three digits)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else None


class _Fence:
    """Marks when a device-to-host copy has landed: a CUDA event, or nothing on the host."""

    def __init__(self, device: torch.device) -> None:
        self._event = (torch.cuda.Event() if device.type == "cuda"  # type: ignore[no-untyped-call]
                       else None)
        if self._event is not None:
            self._event.record()

    def wait(self) -> None:
        """Block the calling thread (never the training thread) until the copy is done."""
        if self._event is not None:
            self._event.synchronize()

    def done(self) -> bool:
        """The copy has landed (asks the device without waiting for it)."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]


class _Background:
    """Marks when a CPU kernel running on the probe's own thread has finished."""

    def __init__(self, job: Future[tuple[UpdateStats, list[int]]]) -> None:
        self._job = job

    def wait(self) -> None:
        self._job.result()

    def done(self) -> bool:
        return self._job.done()


class PendingStats:
    """One step's figures on their way, read later and off the training thread.

    On an accelerator the training thread only queues the device work and a non-blocking copy
    into pinned host memory; ``result()`` (called by the sender thread) waits for that copy
    and summarises. Every step gets its own host buffer, so a later step never overwrites an
    unread one. On the CPU the probe's own thread measures and summarises; ``result()`` waits
    for it.
    """

    def __init__(self, read: Callable[[], UpdateStats],
                 fences: Sequence[_Fence | _Background]) -> None:
        self._read: Callable[[], UpdateStats] | None = read
        self._fences = fences
        self._stats: UpdateStats | None = None
        self._lock = threading.Lock()

    def peek(self) -> UpdateStats | None:
        """The figures if reading them now costs no wait (read already, or their device copy
        or background kernel has finished); else None."""
        if self._stats is None and all(fence.done() for fence in self._fences):
            return self.result()
        return self._stats

    def result(self) -> UpdateStats:
        """The step's figures; waits for the device copy the first time."""
        with self._lock:
            if self._stats is None:
                for fence in self._fences:
                    fence.wait()
                assert self._read is not None
                self._stats = self._read()
                self._read = None
            return self._stats


class _Kernel(Protocol):
    """What UpdateProbe needs from a kernel."""

    snapshot_bytes: int

    def refresh(self) -> None:
        """Copy the sources into the snapshot."""

    def run(self) -> tuple[Callable[[], torch.Tensor], list[_Fence]]:
        """Queue the measurement: a reader of the (tensors x FIGURES) figures, to call once
        the fences have passed."""


class _NativeKernel:
    """The installed C kernel (CPU): one pass, snapshot refreshed in the same loop."""

    def __init__(self, lib: ctypes.CDLL, sources: list[torch.Tensor]) -> None:
        self._sources = sources
        self._buffers, self.snapshot = _flat_snapshot(sources)
        self.snapshot_bytes = sum(b.numel() for b in self._buffers)
        self._pass = update_native.NativePass(lib, sources, self.snapshot)

    def refresh(self) -> None:
        torch._foreach_copy_(self.snapshot, self._sources)

    def run(self) -> tuple[Callable[[], torch.Tensor], list[_Fence]]:
        figures = self._pass.run().clone()  # the kernel's buffer is reused by the next step
        return (lambda: figures), []


class _ChunkedKernel:
    """The CPU torch kernel: eager ops over cache-sized chunks of 2-D blocks, double-buffered.

    The snapshot is ours, so it is laid out for eager torch: every tensor is cut into pieces
    (whole, or rows of at most ``MAX_ROW`` elements), and pieces of the same length sit back to
    back, so a run of them is one (pieces x length) block. Per chunk of such rows, five ops
    compute every figure of every piece in the chunk (see ``_ChunkedDtype``): the copy of the
    new weights into the spare half of the snapshot is the only write to memory, and the chunk
    stays in L2 for all but the first read of each byte. The spare becomes the snapshot, so no
    refresh copy is needed. The op count does not grow with the number of tensors: an adapter's
    hundreds of tensors have a handful of distinct lengths (Qwen3-0.6B r16: 392 tensors, three
    lengths, 88 chunks of 256 KiB in bf16).

    Eager ops run one after another on one thread, so their compute adds to the memory time
    instead of hiding behind it: ``python -m bench`` prints both (bfloat16 arithmetic costs
    about as much as moving the bytes, which keeps this path well above the bandwidth bound).
    """

    def __init__(self, sources: list[torch.Tensor], chunk_bytes: int | None = None) -> None:
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        self._sources = sources
        self._count = len(sources)
        self._parts: list[_ChunkedDtype] = []
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, src in enumerate(sources):
            by_dtype.setdefault(src.dtype, []).append(i)
        for idx in by_dtype.values():
            self._parts.append(_ChunkedDtype([sources[i] for i in idx], idx, chunk_bytes))
        self.snapshot_bytes = sum(p.snapshot_bytes for p in self._parts)

    @property
    def snapshot(self) -> list[torch.Tensor]:
        """The current snapshot views, in source order."""
        views: list[torch.Tensor] = [torch.empty(0)] * self._count
        for part in self._parts:
            for i, view in zip(part.rows, part.current, strict=True):
                views[i] = view
        return views

    def refresh(self) -> None:
        for part in self._parts:
            part.refresh()

    def run(self) -> tuple[Callable[[], torch.Tensor], list[_Fence]]:
        out = torch.zeros(self._count, update_native.FIGURES, dtype=torch.float64)
        with torch.no_grad():
            for part in self._parts:
                out[part.rows_index] = part.run()
        return (lambda: out), []


#: Longest row of the CPU torch kernel's blocks, in elements. The changed elements of a row
#: are summed as 0/1 lanes packed into int64 words (four 16-bit lanes, two 32-bit ones), which
#: is exact while a lane counts fewer than 2**16 ones: rows of 16-bit elements stay under
#: 4 x 2**16.
MAX_ROW = 128 * 1024


@dataclass(frozen=True)
class _Chunk:
    """One chunk's operands for one parity of the double buffer (all views, made once)."""

    sources: list[torch.Tensor]  # the pieces of the weights, flat when ``flat``
    flat: bool  # every piece contiguous: one torch.cat copies them
    new: torch.Tensor  # (rows x length) receiving the weights
    new_slots: list[torch.Tensor]  # per piece, shaped like its source (when not flat)
    old: torch.Tensor  # (rows x length) holding the last snapshot; becomes new - old
    both: torch.Tensor  # (2 x rows x length): the chunk's two halves, ``new`` and ``old``
    new_bits: torch.Tensor  # ``new`` and ``old`` as integers of the same width
    old_bits: torch.Tensor
    mask: torch.Tensor  # (rows x length) integer 0/1 scratch: bytes differ
    lanes: torch.Tensor  # ``mask`` as (rows x words) int64, or ``mask`` itself
    norms_out: torch.Tensor  # (2 x rows) view of the per-piece norms, by half
    moved_out: torch.Tensor  # (rows,) slice of the per-piece changed-element counts


class _ChunkedDtype:
    """The chunked CPU kernel for the sources of one dtype.

    Layout: each chunk owns two adjacent halves of one buffer, one per parity of the double
    buffer, so a chunk's new weights and its old snapshot form one (2 x rows x length) view.
    Per chunk: copy the weights into the new half, count the elements whose bytes differ,
    subtract the old half in place (it is the spare for the next step), then one norm call
    gives the weights' and the update's row norms together.
    """

    def __init__(self, sources: list[torch.Tensor], rows: list[int], chunk_bytes: int) -> None:
        self.rows = rows
        self.rows_index = torch.tensor(rows, dtype=torch.int64)
        self._sources = sources
        dtype = sources[0].dtype
        self._bits = _int_view(dtype)
        size = torch.empty(0, dtype=dtype).element_size()
        limit = max(chunk_bytes // size, 1)
        row = min(limit, MAX_ROW)
        # pieces: whole tensors, or rows of a contiguous tensor longer than a row
        pieces: list[tuple[int, torch.Tensor]] = []
        for i, src in enumerate(sources):
            if src.numel() > row and src.is_contiguous():
                flat = src.view(-1)
                pieces += [(i, flat[a:a + row]) for a in range(0, src.numel(), row)]
            elif src.numel():
                pieces.append((i, src))
        # pieces of one length back to back; chunks: runs of at most ``limit`` elements of them
        by_length: dict[int, list[int]] = {}
        for k, (_, piece) in enumerate(pieces):
            by_length.setdefault(piece.numel(), []).append(k)
        self._pieces = [pieces[k] for ks in by_length.values() for k in ks]
        spans: list[tuple[int, int, int]] = []  # (first piece, pieces, length)
        first = 0
        for length, ks in by_length.items():
            per = max(limit // length, 1)
            spans += [(p, min(per, first + len(ks) - p), length)
                      for p in range(first, first + len(ks), per)]
            first += len(ks)
        # each chunk starts on a cache line; its two halves follow each other
        align = max(_ALIGN // size, 1)
        bases: list[int] = []
        at = 0
        for _, count, length in spans:
            at = -(-at // align) * align
            bases.append(at)
            at += 2 * count * length
        self._store = torch.zeros(max(at, 1), dtype=dtype)
        self.snapshot_bytes = max(at, 1) * size
        # where each piece lies in half 0 (half 1 is count * length further)
        self._offsets: list[int] = []
        self._half: list[int] = []
        for (_, count, length), base in zip(spans, bases, strict=True):
            self._offsets += [base + j * length for j in range(count)]
            self._half += [count * length] * count
        lanes = 8 // size if size < 8 else 1  # 0/1 lanes per int64 word of the mask
        self._lanes = lanes
        self._mask = torch.zeros(max([c * n for _, c, n in spans] + [1]), dtype=self._bits)
        count = len(self._pieces)
        self._norms = torch.zeros(count, 2, dtype=dtype)
        self._moved = torch.zeros(count, dtype=torch.int64)
        self._packed = torch.tensor([lanes > 1 and n % lanes == 0 and n // lanes < 2 ** (8 * size)
                                     for _, c, n in spans for _ in range(c)], dtype=torch.bool)
        self._owner = torch.tensor([i for i, _ in self._pieces], dtype=torch.int64)
        self._numel = torch.tensor([float(s.numel()) for s in sources], dtype=torch.float64)
        self._plans = [[self._chunk(span, base, half) for span, base in zip(spans, bases,
                                                                           strict=True)]
                       for half in (0, 1)]
        self._tensor_views = [self._tensor_slots(half) for half in (0, 1)]
        self._current = 0

    def _chunk(self, span: tuple[int, int, int], base: int, new: int) -> _Chunk:
        """The operands of one chunk when its half ``new`` receives the weights."""
        first, count, length = span
        size = count * length
        both = self._store[base:base + 2 * size].view(2, count, length)
        new_half, old_half = both[new], both[1 - new]
        pieces = [p for _, p in self._pieces[first:first + count]]
        flat = all(p.is_contiguous() for p in pieces)
        mask = self._mask[:size].view(count, length)
        packed = bool(self._packed[first])
        return _Chunk(
            sources=[p.view(-1) for p in pieces] if flat else pieces,
            flat=flat,
            new=new_half,
            new_slots=[new_half[j].view(p.shape) for j, p in enumerate(pieces)],
            old=old_half,
            both=both,
            new_bits=new_half.view(self._bits),
            old_bits=old_half.view(self._bits),
            mask=mask,
            lanes=mask.view(torch.int64) if packed else mask,
            norms_out=self._norms[first:first + count].t(),
            moved_out=self._moved[first:first + count],
        )

    def _tensor_slots(self, half: int) -> list[list[torch.Tensor]]:
        slots: list[list[torch.Tensor]] = [[] for _ in self._sources]
        for (i, piece), offset, skip in zip(self._pieces, self._offsets, self._half,
                                            strict=True):
            at = offset + half * skip
            slots[i].append(self._store[at:at + piece.numel()].view(piece.shape))
        return slots

    @property
    def current(self) -> list[torch.Tensor]:
        """The snapshot of each source (a view when it is one piece, else a copy)."""
        return [parts[0] if len(parts) == 1
                else torch.cat([p.reshape(-1) for p in parts]) if parts
                else torch.empty(src.shape, dtype=src.dtype)
                for parts, src in zip(self._tensor_views[self._current], self._sources,
                                      strict=True)]

    @staticmethod
    def _copy(chunk: _Chunk) -> None:
        if chunk.flat:
            torch.cat(chunk.sources, out=chunk.new.view(-1))
        else:
            torch._foreach_copy_(chunk.new_slots, chunk.sources)

    def refresh(self) -> None:
        # the plan that writes the weights into the half that is now current
        for chunk in self._plans[self._current]:
            self._copy(chunk)

    @property
    def next_chunks(self) -> list[_Chunk]:
        """The chunks the next ``run`` measures (for the bench's compute-only floor)."""
        return self._plans[1 - self._current]

    @classmethod
    def measure(cls, chunk: _Chunk) -> None:
        """Every figure of one chunk's pieces; the old half is left holding new - old."""
        cls._copy(chunk)
        torch.ne(chunk.new_bits, chunk.old_bits, out=chunk.mask)
        torch.sum(chunk.lanes, dim=1, out=chunk.moved_out)
        torch.sub(chunk.new, chunk.old, out=chunk.old)
        # 16-bit norms come back in 16 bits (three digits, accumulated in float32): asking
        # for float32 output triples their cost
        torch.linalg.vector_norm(chunk.both, dim=2, out=chunk.norms_out)

    def run(self) -> torch.Tensor:
        """(tensors x FIGURES) for this dtype; afterwards the other half is the snapshot.

        The old half is overwritten: until ``run`` returns, the snapshot is not valid (the
        probe marks it so, and copies again if ``run`` fails).
        """
        new = 1 - self._current
        measure = self.measure
        for chunk in self._plans[new]:
            measure(chunk)
        self._current = new
        moved = self._moved
        if self._lanes > 1:
            width = 64 // self._lanes
            unpacked = sum(((moved >> (width * k)) & ((1 << width) - 1)
                            for k in range(self._lanes)), torch.zeros_like(moved))
            moved = torch.where(self._packed, unpacked, moved)
        norms = self._norms.double().square()
        per_piece = torch.stack([norms[:, 1 - new], norms[:, new], moved.double()], dim=1)
        sums = torch.zeros(len(self._sources), 3, dtype=torch.float64).index_add_(
            0, self._owner, per_piece)
        nonfinite = ~torch.isfinite(sums[:, 0])
        return torch.stack([sums[:, 0], sums[:, 1], (sums[:, 2] > 0).double(),
                            nonfinite.double(), self._numel - sums[:, 2]], dim=1)


class _DeviceKernel:
    """Multi-tensor ops for accelerators: no per-tensor launch loop and no host sync.

    The figures are computed on the device and copied to pinned host memory without blocking;
    the training thread never waits (see PendingStats). "Changed" is a count of elements with
    sign(old - new) != 0, so there +0.0 and -0.0 count as equal.
    """

    def __init__(self, sources: list[torch.Tensor]) -> None:
        self._sources = sources
        self._buffers, self.snapshot = _flat_snapshot(sources)
        self.snapshot_bytes = sum(b.numel() for b in self._buffers)
        parts: dict[torch.device, dict[torch.dtype, list[int]]] = {}
        for i, src in enumerate(sources):
            parts.setdefault(src.device, {}).setdefault(src.dtype, []).append(i)
        self._devices = [
            (device, torch.tensor([i for idx in by_dtype.values() for i in idx]),
             [(dtype, [sources[i] for i in idx], [self.snapshot[i] for i in idx])
              for dtype, idx in by_dtype.items()])
            for device, by_dtype in parts.items()
        ]
        self._numel = torch.tensor([float(s.numel()) for s in sources], dtype=torch.float64)

    def refresh(self) -> None:
        torch._foreach_copy_(self.snapshot, self._sources)

    def run(self) -> tuple[Callable[[], torch.Tensor], list[_Fence]]:
        hosts: list[tuple[torch.Tensor, torch.Tensor]] = []
        fences: list[_Fence] = []
        with torch.no_grad():
            for device, rows, parts in self._devices:
                on_device = torch.cat([self._run(*part) for part in parts], dim=1)
                host = torch.empty(on_device.shape, dtype=torch.float64,
                                   pin_memory=device.type == "cuda")
                host.copy_(on_device, non_blocking=True)
                fences.append(_Fence(device))
                hosts.append((rows, host))
        return _DeviceFigures(hosts, self._numel, len(self._sources)).finish, fences

    @staticmethod
    def _run(dtype: torch.dtype, srcs: list[torch.Tensor],
             snaps: list[torch.Tensor]) -> torch.Tensor:
        """(3 x tensors) float64 on the device: update L2, weight L2, changed elements."""
        wide = _wide(dtype)
        torch._foreach_sub_(snaps, srcs)  # snapshot := old - new
        diff_l2 = torch._foreach_norm(snaps, 2, dtype=wide)
        weight_l2 = torch._foreach_norm(srcs, 2, dtype=wide)
        torch._foreach_sign_(snaps)
        moved = torch._foreach_norm(snaps, 1, dtype=wide)  # NaN where a value is not finite
        torch._foreach_copy_(snaps, srcs)  # refreshed for the next step
        return torch.stack([torch.stack(diff_l2).double(), torch.stack(weight_l2).double(),
                            torch.stack(moved).double()])


class _DeviceFigures:
    """Lazily turns the raw (3 x tensors) device rows into the (tensors x FIGURES) figures."""

    def __init__(self, hosts: list[tuple[torch.Tensor, torch.Tensor]], numel: torch.Tensor,
                 count: int) -> None:
        self._hosts = hosts
        self._numel = numel
        self._count = count

    def finish(self) -> torch.Tensor:
        out = torch.zeros(self._count, update_native.FIGURES, dtype=torch.float64)
        for rows, host in self._hosts:
            moved = host[2]
            finite = torch.isfinite(host[0]) & torch.isfinite(moved)
            out[rows] = torch.stack([
                host[0].square(), host[1].square(), (moved != 0).double(),
                (~finite).double(), torch.where(finite, self._numel[rows] - moved, 0.0),
            ], dim=1)
        return out


def _native_kernel(sources: list[torch.Tensor]) -> _NativeKernel | None:
    """The installed C kernel when every tensor suits it and the install carries it."""
    if not sources or not update_native.NativePass.supports(sources):
        return None
    lib = update_native.load()
    return None if lib is None else _NativeKernel(lib, sources)


def _sample_runs(sample: int) -> int:
    """How many runs a sample is cut into: its largest divisor up to 64, or single elements
    when it has no divisor of 8 or more (a prime, say)."""
    best = max(d for d in range(1, min(64, sample) + 1) if sample % d == 0)
    return best if best >= 8 else sample


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
    ) -> None:
        self.watched_params = sum(t.numel() for t in tensors)
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
                and all(s.device.type == "cpu" for s in self._sources))
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
        self._sources = [self._view(t.detach(), self._sample) for t in self._tensors]
        self._valid_at: list[int] | None = None  # versions at which snapshot == weights
        self._elements = torch.tensor([float(s.numel()) for s in self._sources],
                                      dtype=torch.float64)
        native = None if self._path == "torch" else _native_kernel(self._sources)
        if self._path == "native" and native is None:
            raise RuntimeError("the native update kernel is unavailable for these tensors")
        kernel: _NativeKernel | _ChunkedKernel | _DeviceKernel
        if native is not None:
            kernel = native
        elif all(s.device.type == "cpu" for s in self._sources):
            kernel = _ChunkedKernel(self._sources)
        else:
            kernel = _DeviceKernel(self._sources)
        self._kernel = kernel
        self.path: str = "native" if native is not None else "torch"
        #: CPU kernels run on the probe's own thread (see ``after_step_deferred``); the device
        #: kernel only queues work, so it stays on the training thread.
        self.in_background = self._background and not isinstance(kernel, _DeviceKernel)
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
            return PendingStats(lambda: job.result()[0], [_Background(job)])
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
