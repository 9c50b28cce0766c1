"""Checkpoint audit from the bytes on disk: safetensors headers, per-tensor hashes, no pickle.

A safetensors file is an 8-byte little-endian header length, a JSON header (dtype, shape and
byte range of every tensor) and the raw tensor bytes. Each tensor is hashed with xxh3-128 over
its byte range, read in chunks, the same digest ``callbacks/digest.py`` computes in memory, so
a checkpoint can be compared with the adapter the run started from. Plain reads, not a memory
map: a file rewritten in place shrinks under a mapped reader and the whole process dies of
SIGBUS; a read just comes up short, and the file is reported as changed while read. Pickle files
(``.bin``, ``.pt``) are listed, never opened: unpickling runs arbitrary code.

Files come from folders a client named, so every open is defensive: ``O_NOFOLLOW`` (no symlink
swapped in at the last moment), ``O_NONBLOCK`` (a FIFO swapped in cannot block the watcher) and
an ``fstat`` of the open descriptor (a regular file, or nothing is read). The header length and
the number of tensors are capped before the JSON is parsed, so a hostile header costs a refusal
(``CheckpointRefused``), not the sidecar's memory limit.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import xxhash

from ..model.inspection import CheckpointInspection, TensorFacts, Value
from . import adapter_methods
from .adapter_methods import Method

#: Largest safetensors header accepted. A LoRA on every linear layer of a 70B model has ~1.1k
#: tensors (~200 kB of header); parsing a JSON header costs ~15x its size in Python objects,
#: so 16 MiB keeps one inspection well inside the sidecar's memory limit.
MAX_HEADER_BYTES = 16 * 1024 * 1024
#: Most tensors in one file (the same bound as an adapter digest reported by a client).
MAX_TENSORS = 65536
#: Largest tensor dimension accepted (2^53: every larger size is nonsense and float-unsafe).
MAX_DIMENSION = 2**53
#: Weight files in the order they are looked for in a checkpoint folder.
ADAPTER_FILE = "adapter_model.safetensors"
MODEL_FILES = ("model.safetensors",)
#: Pickled files the Trainer writes for resuming (optimizer, scheduler, RNG, arguments): always
#: present, never weights; flagging them would flag every checkpoint.
TRAINER_STATE_FILES = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
#: Parameter counts per safetensors dtype name.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
#: Bytes read at a time while hashing (a multiple of every dtype width).
READ_CHUNK = 8 * 1024 * 1024
#: The bytes of 1.0 per float dtype (little-endian), for the identities that start at ones.
ONE_BYTES = {
    "F64": struct.pack("<d", 1.0), "F32": struct.pack("<f", 1.0), "F16": struct.pack("<e", 1.0),
    "BF16": struct.pack("<f", 1.0)[2:],
}


class NotACheckpoint(ValueError):
    """The path holds no weights deadweight can audit (or the file is not valid safetensors)."""


class CheckpointRefused(NotACheckpoint):
    """The file is refused before it is read: not a regular file, a symlink, or over a cap."""


def open_regular(path: Path) -> BinaryIO:
    """Open path for reading only if it is a regular file (never a FIFO, device or symlink)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:  # the last component is a symlink
            raise CheckpointRefused(f"{path}: is a symlink; not followed") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointRefused(f"{path}: not a regular file (mode "
                                    f"{stat.filemode(info.st_mode)}); not read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def combine(tensors: dict[str, str]) -> str:
    """One digest over name:digest pairs in name order (same as ``callbacks.digest.combine``)."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        h.update(f"{name}:{tensors[name]}\n".encode())
    return h.hexdigest()


def _all_zero(data: memoryview, dtype: str) -> bool:
    """Exact zero test on raw little-endian bytes; floats ignore the sign bit (-0.0 is zero).

    Byte-string operations only (they run in C, and the sidecar needs no numpy): the sign is
    the top bit of each element's last byte, which may be 0x00 or 0x80; all else must be 0.
    """
    raw = bytes(data)
    if raw.count(0) == len(raw):
        return True
    width = DTYPE_BYTES.get(dtype, 1)
    if not dtype.startswith(("F", "BF")) or len(raw) % width:
        return False
    if any(raw[i::width].count(0) != len(raw) // width for i in range(width - 1)):
        return False
    return not raw[width - 1::width].translate(None, b"\x00\x80")


def _all_one(data: memoryview, dtype: str) -> bool:
    """Every element is exactly 1.0 (chunks are whole elements: READ_CHUNK is a multiple)."""
    one = ONE_BYTES.get(dtype)
    return one is not None and len(data) % len(one) == 0 and bytes(data) == one * (
        len(data) // len(one))


def _still(value: Value, data: memoryview, dtype: str) -> bool:
    return _all_zero(data, dtype) if value is Value.ZERO else _all_one(data, dtype)


def _dimension(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DIMENSION


def _offset(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_header(path: Path, handle: BinaryIO | None = None
                ) -> tuple[dict[str, dict[str, object]], int]:
    """The tensor entries of a safetensors header and the offset where tensor data starts.

    Every entry is checked here (offsets and shape are non-negative integers inside the file),
    so callers can trust the types; anything else is ``NotACheckpoint`` with a reason.
    """
    if handle is None:
        with open_regular(path) as opened:
            return read_header(path, opened)
    size = os.fstat(handle.fileno()).st_size
    handle.seek(0)
    head = handle.read(8)
    if len(head) < 8:
        raise NotACheckpoint(f"{path}: too short to be safetensors")
    (length,) = struct.unpack("<Q", head)
    if length > size - 8:
        raise NotACheckpoint(f"{path}: header length {length} is not valid safetensors")
    if length > MAX_HEADER_BYTES:
        raise CheckpointRefused(f"{path}: header of {length} bytes is over the cap of "
                                f"{MAX_HEADER_BYTES} bytes; not parsed")
    raw = handle.read(length)
    if raw.count(b'"data_offsets"') > MAX_TENSORS:
        raise CheckpointRefused(f"{path}: more than {MAX_TENSORS} tensors; not parsed")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise NotACheckpoint(f"{path}: header is not JSON ({str(err)[:200]})") from None
    if not isinstance(header, dict):
        raise NotACheckpoint(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + length
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise NotACheckpoint(f"{path}: tensor {name[:200]!r} is not a JSON object")
        offsets = entry.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_offset(x) for x in offsets)
                or not offsets[0] <= offsets[1] <= size - start):
            raise NotACheckpoint(f"{path}: tensor {name[:200]!r} has invalid data_offsets")
        shape = entry.get("shape", [])
        if not isinstance(shape, list) or not all(_dimension(d) for d in shape):
            raise NotACheckpoint(f"{path}: tensor {name[:200]!r} has an invalid shape")
        if not isinstance(entry.get("dtype", ""), str):
            raise NotACheckpoint(f"{path}: tensor {name[:200]!r} has an invalid dtype")
    return header, start


def _chunks(handle: BinaryIO, path: Path, begin: int, end: int) -> Iterator[bytes]:
    """The bytes begin..end of an open file; a file that shrank meanwhile is not a checkpoint."""
    handle.seek(begin)
    left = end - begin
    while left > 0:
        chunk = handle.read(min(READ_CHUNK, left))
        if not chunk:
            raise NotACheckpoint(f"{path}: file shrank while it was read (rewritten in place?)")
        left -= len(chunk)
        yield chunk


def _identity_values(name: str, method: Method | None) -> list[Value]:
    """The identity values worth testing on this tensor (none for most tensors)."""
    if method is None:
        return []
    segment = adapter_methods.segment_of(name, method)
    return [v for alt in method.identity for s, v in alt if s == segment]


def hash_file(path: Path, method: Method | None = None) -> list[TensorFacts]:
    """Facts about every tensor of a safetensors file, hashed chunk by chunk.

    With the adapter's method, the tensors its identity names are also tested for the
    identity value (exact bytes, no float conversion).
    """
    facts: list[TensorFacts] = []
    with open_regular(path) as handle:
        header, start = read_header(path, handle)
        if method is None and path.name == ADAPTER_FILE:
            method = adapter_methods.resolve(adapter_methods.configured_type(path.parent),
                                             header)
        for name in sorted(header):
            entry = header[name]
            begin, end = (int(x) for x in entry["data_offsets"])  # type: ignore[attr-defined]
            dtype = str(entry.get("dtype", ""))  # type: ignore[attr-defined]
            shape = [int(d) for d in entry.get("shape", [])]  # type: ignore[attr-defined]
            params = math.prod(shape)
            digest = xxhash.xxh3_128()
            candidates = _identity_values(name, method) if params else []
            for chunk in _chunks(handle, path, start + begin, start + end):
                digest.update(chunk)
                candidates = [v for v in candidates if _still(v, memoryview(chunk), dtype)]
            facts.append(TensorFacts(
                name=name, dtype=dtype, params=params, nbytes=end - begin,
                digest=digest.hexdigest(), constant=candidates[0] if candidates else None,
            ))
    return facts


def _identity_count(tensors: list[TensorFacts], method: Method) -> tuple[int, int]:
    """(modules the identity can judge, modules no longer at it)."""
    modules: dict[str, dict[str, Value | None]] = {}
    for t in tensors:
        segment = adapter_methods.segment_of(t.name, method)
        if segment is not None and segment in method.identity_segments:
            modules.setdefault(adapter_methods.module_of(t.name, segment), {})[segment] = (
                t.constant)
    judged = moved = 0
    for held in modules.values():
        alternatives = [alt for alt in method.identity if all(s in held for s, _ in alt)]
        if not alternatives:
            continue
        judged += 1
        if not any(all(held[s] is v for s, v in alt) for alt in alternatives):
            moved += 1
    return judged, moved


def _pickles(folder: Path) -> tuple[str, ...]:
    found = []
    for candidate in sorted(folder.iterdir()):
        if (candidate.is_file() and candidate.suffix in PICKLE_SUFFIXES
                and candidate.name not in TRAINER_STATE_FILES
                and not candidate.name.startswith("rng_state")):
            found.append(candidate.name)
    return tuple(found)


def _weights_in(folder: Path) -> Path | None:
    for name in (ADAPTER_FILE, *MODEL_FILES):
        if (folder / name).is_file():
            return folder / name
    return None


def holds_weights(folder: Path) -> bool:
    """Whether ``inspect_path`` would find weights in folder (a listing, nothing read)."""
    return _weights_in(folder) is not None or bool(_pickles(folder))


def inspect_file(path: Path, folder: Path | None = None) -> CheckpointInspection:
    """Audit one safetensors weights file (its folder supplies the pickle listing).

    A file of 0 bytes is weights that were never written (a partitioned save): it is
    reported as a weights file without tensors, not refused.
    """
    info = path.lstat()  # a FIFO or symlink is not an empty file: open_regular refuses it
    if stat.S_ISREG(info.st_mode) and info.st_size == 0:
        return CheckpointInspection(
            path=str(folder or path), weights_file=path.name,
            is_adapter=path.name == ADAPTER_FILE, adapter_digest=combine({}),
            method=adapter_methods.configured_type(path.parent),
            pickle_files=_pickles(folder) if folder is not None else ())
    header, _ = read_header(path)
    configured = adapter_methods.configured_type(path.parent)
    method = adapter_methods.resolve(configured, header)
    own = {n for n in header if adapter_methods.segment_of(n, method) is not None}
    is_adapter = path.name == ADAPTER_FILE or bool(configured) or (
        method is not adapter_methods.UNKNOWN and bool(own))
    tensors = hash_file(path, method if is_adapter else None)
    digests = {t.name: t.digest for t in tensors}
    adapter = [t for t in tensors if t.name in own]
    judged, moved = _identity_count(adapter, method) if is_adapter else (0, 0)
    return CheckpointInspection(
        path=str(folder or path),
        weights_file=path.name,
        is_adapter=is_adapter,
        adapter_digest=combine(digests),
        tensor_digests=digests,
        tensor_count=len(digests),
        tensor_bytes=sum(t.nbytes for t in tensors),
        method=method.peft_type if is_adapter else "",
        identity=method.describe_identity() if is_adapter else "",
        adapter_tensors=len(adapter),
        adapter_params=sum(t.params for t in adapter),
        identity_modules=judged,
        moved_modules=moved,
        non_adapter=tuple((t.name, t.params) for t in tensors if t.name not in own)
        if is_adapter else (),
        empty_tensors=tuple(t.name for t in tensors if t.params == 0),
        pickle_files=_pickles(folder) if folder is not None else (),
    )


def inspect_path(path: Path) -> CheckpointInspection:
    """Audit a checkpoint folder, a safetensors file or a pickle file (listed, not opened)."""
    if path.is_dir():
        weights = _weights_in(path)
        if weights is None:
            pickles = _pickles(path)
            if not pickles:
                raise NotACheckpoint(
                    f"{path}: no {ADAPTER_FILE}, model.safetensors or pickled weights here"
                )
            return CheckpointInspection(path=str(path), pickle_files=pickles)
        return inspect_file(weights, path)
    if not path.is_file():
        raise NotACheckpoint(f"{path}: no such file or folder")
    if path.suffix in PICKLE_SUFFIXES:
        return CheckpointInspection(path=str(path), pickle_files=(path.name,))
    if path.suffix != ".safetensors":
        raise NotACheckpoint(f"{path}: not a .safetensors file or a checkpoint folder")
    return inspect_file(path)
