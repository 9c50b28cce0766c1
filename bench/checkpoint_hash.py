"""Checkpoint verification throughput: per-tensor hashes over a safetensors file (warm cache).

The file is parsed from its header (8-byte length, JSON with data_offsets), never unpickled or
loaded into tensors; each tensor's byte range is hashed from an mmap (no copy) or after a read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save_file

from .common import table, verdict
from .shapes import LLAMA3_8B_R64, QWEN3_06B_R16, ModelShape, make_adapter

BUDGET_GBPS = 10.0


def tensor_ranges(path: Path) -> list[tuple[int, int]]:
    """Absolute (start, end) byte ranges of every tensor, from the header only."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    return [(base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"]


def _map(fileno: int, populate: bool) -> mmap.mmap:
    """A read-only shared mapping; MAP_POPULATE maps every page in one call (Linux)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fileno, 0, flags=flags, prot=mmap.PROT_READ)


def hash_mmap(path: Path, new: Callable[[], object], populate: bool = False) -> list[str]:
    """Hash each tensor's slice of an mmap of the file."""
    ranges = tensor_ranges(path)
    out = []
    with path.open("rb") as f, _map(f.fileno(), populate) as mm:
        view = memoryview(mm)
        for start, end in ranges:
            h = new()
            h.update(view[start:end])  # type: ignore[attr-defined]
            out.append(h.hexdigest())  # type: ignore[attr-defined]
        view.release()
    return out


def hash_read(path: Path, new: Callable[[], object]) -> list[str]:
    """Read the whole file into memory, then hash each tensor's slice."""
    ranges = tensor_ranges(path)
    data = memoryview(path.read_bytes())
    out = []
    for start, end in ranges:
        h = new()
        h.update(data[start:end])  # type: ignore[attr-defined]
        out.append(h.hexdigest())  # type: ignore[attr-defined]
    return out


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm the page cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(repeats: int, quick: bool) -> list[list[str]]:
    """GB/s of each method on adapter files of two sizes."""
    shapes: list[tuple[ModelShape, torch.dtype]] = [(QWEN3_06B_R16, torch.float32)]
    if not quick:
        shapes.append((LLAMA3_8B_R64, torch.bfloat16))
    methods: list[tuple[str, Callable[[Path], object], bool]] = [
        ("xxh3-128 over mmap slices", lambda p: hash_mmap(p, xxhash.xxh3_128), True),
        ("xxh3-128 over mmap slices, MAP_POPULATE",
         lambda p: hash_mmap(p, xxhash.xxh3_128, populate=True), False),
        ("xxh3-64 over mmap slices", lambda p: hash_mmap(p, xxhash.xxh3_64), True),
        ("xxh3-128 after read()", lambda p: hash_read(p, xxhash.xxh3_128), False),
        ("sha256 over mmap slices", lambda p: hash_mmap(p, hashlib.sha256), False),
        ("blake2b over mmap slices", lambda p: hash_mmap(p, hashlib.blake2b), False),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape, dtype in shapes:
            tensors = make_adapter(shape, dtype)
            path = Path(tmp) / "adapter_model.safetensors"
            save_file({f"t{i}": t for i, t in enumerate(tensors)}, str(path))
            nbytes = path.stat().st_size
            del tensors
            for name, fn, budgeted in methods:
                seconds = _best(functools.partial(fn, path), max(3, repeats // 2))
                gbps = nbytes / seconds / 1e9
                rows.append([shape.name, str(dtype).removeprefix("torch."),
                             f"{nbytes / 2**20:.0f} MiB", name, f"{seconds * 1e3:.1f} ms",
                             f"{gbps:.1f} GB/s",
                             f">= {BUDGET_GBPS:.0f} GB/s " + verdict(gbps >= BUDGET_GBPS)
                             if budgeted else "reference"])
            path.unlink()
    table("checkpoint verification (per-tensor hashes, warm page cache, 1 thread)",
          ["adapter", "dtype", "file", "method", "best", "throughput", "budget"], rows)
    return rows
