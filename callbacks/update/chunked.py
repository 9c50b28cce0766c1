"""The CPU torch kernel of the update measurement, for installs without the native one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kernel import (
    ALIGN,
    CHUNK_BYTES,
    FIGURES,
    int_view,
)
from .stats import Fence


class ChunkedKernel:
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

    def run(self) -> tuple[Callable[[], torch.Tensor], list[Fence]]:
        out = torch.zeros(self._count, FIGURES, dtype=torch.float64)
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
        self._bits = int_view(dtype)
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
        align = max(ALIGN // size, 1)
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

