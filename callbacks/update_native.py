"""A one-pass CPU kernel for the update measurement, built once with the system C compiler.

Eager torch needs several passes over the weights (copy, subtract, two norms); on CPU that costs
2.4-4.3x the memory-bandwidth bound. This kernel reads the new weights and the snapshot once,
accumulates the squared update and squared weights in float64, compares bytes for the exact
"unchanged" test, flags non-finite values, and writes the new weights into the snapshot in the
same loop, so the snapshot is already refreshed for the next step.

The C source is compiled on first use (about 0.2 s) into a per-user cache directory and loaded
with ctypes: no Python headers, no torch headers. ``target_clones`` picks AVX-512/AVX2 code at
load time, so a cache shared between different CPUs stays safe. Without a compiler, or with
``DEADWEIGHT_NATIVE=0``, ``load()`` returns None and the caller uses the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

#: dtype codes understood by the kernel.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float64: 2}
#: Figures per tensor in the output: update sq sum, weight sq sum, bytes differ, non-finite.
FIGURES = 4

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DW_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DW_CLONES
#endif

static inline float bf16_to_f(uint32_t b) {
  uint32_t u = b << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline float u32_to_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline double u64_to_d(uint64_t u) { double f; memcpy(&f, &u, 8); return f; }

/* One contiguous run of n elements: accumulate into acc[4] (update sq, weight sq, bytes
   differ, non-finite) and copy w into s. Non-finite is read from the bits (exponent all ones).
   float32/float64 accumulate in float64; bf16 would be compute-bound there, so it sums blocks
   of 2048 exact float32 products and adds the block sums in float64. */
DW_CLONES static void run_f32(const uint32_t *w, uint32_t *s, int64_t n, double *acc) {
  double du = 0.0, dw = 0.0; uint32_t ch = 0, nf = 0;
  _Pragma("omp simd reduction(+:du,dw) reduction(|:ch,nf)")
  for (int64_t j = 0; j < n; ++j) {
    uint32_t x = w[j], y = s[j]; double a = u32_to_f(x), d = a - (double)u32_to_f(y);
    du += d * d; dw += a * a; ch |= x ^ y;
    nf |= ((x & 0x7f800000u) + 0x00800000u) | ((y & 0x7f800000u) + 0x00800000u);
    s[j] = x;
  }
  acc[0] += du; acc[1] += dw; acc[2] += ch != 0; acc[3] += (nf & 0x80000000u) != 0;
}

DW_CLONES static void run_f64(const uint64_t *w, uint64_t *s, int64_t n, double *acc) {
  const uint64_t e = 0x7ff0000000000000ull, one = 0x0010000000000000ull;
  double du = 0.0, dw = 0.0; uint64_t ch = 0, nf = 0;
  _Pragma("omp simd reduction(+:du,dw) reduction(|:ch,nf)")
  for (int64_t j = 0; j < n; ++j) {
    uint64_t x = w[j], y = s[j]; double a = u64_to_d(x), d = a - u64_to_d(y);
    du += d * d; dw += a * a; ch |= x ^ y;
    nf |= ((x & e) + one) | ((y & e) + one);
    s[j] = x;
  }
  acc[0] += du; acc[1] += dw; acc[2] += ch != 0; acc[3] += (nf >> 63) != 0;
}

DW_CLONES static void run_bf16(const uint16_t *w, uint16_t *s, int64_t n, double *acc) {
  double du = 0.0, dw = 0.0; uint32_t ch = 0, nf = 0;
  for (int64_t base = 0; base < n; base += 2048) {
    int64_t end = base + 2048 < n ? base + 2048 : n;
    float bu = 0.f, bw = 0.f;
    _Pragma("omp simd reduction(+:bu,bw) reduction(|:ch,nf)")
    for (int64_t j = base; j < end; ++j) {
      uint32_t x = w[j], y = s[j]; float a = bf16_to_f(x), d = a - bf16_to_f(y);
      bu += d * d; bw += a * a; ch |= x ^ y;
      nf |= ((x & 0x7f80u) + 0x80u) | ((y & 0x7f80u) + 0x80u);
      s[j] = (uint16_t)x;
    }
    du += bu; dw += bw;
  }
  acc[0] += du; acc[1] += dw; acc[2] += ch != 0; acc[3] += (nf & 0x8000u) != 0;
}

/* Measure and refresh every tensor. Tensor i is runs[i] contiguous runs of len[i] elements,
   gap[i] elements apart in the source (one run for a whole tensor, several for a sample),
   packed back to back in its snapshot. out[4 i ...] gets its four figures. */
void dw_update(int64_t count, const int64_t *src, const int64_t *snap, const int64_t *runs,
               const int64_t *len, const int64_t *gap, const int64_t *dtype, double *out) {
  for (int64_t i = 0; i < count; ++i) {
    double *o = out + 4 * i;
    o[0] = o[1] = o[2] = o[3] = 0.0;
    for (int64_t r = 0; r < runs[i]; ++r) {
      int64_t at = r * gap[i], to = r * len[i];
      switch (dtype[i]) {
        case 0: run_f32((const uint32_t *)src[i] + at, (uint32_t *)snap[i] + to, len[i], o); break;
        case 1: run_bf16((const uint16_t *)src[i] + at, (uint16_t *)snap[i] + to, len[i], o); break;
        default: run_f64((const uint64_t *)src[i] + at, (uint64_t *)snap[i] + to, len[i], o); break;
      }
    }
    o[2] = o[2] != 0.0; o[3] = o[3] != 0.0;
  }
}
"""

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    """A directory only this user can write, so nobody else can plant the library we load."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "deadweight"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.stat().st_uid == os.getuid():
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="deadweight-"))


def _compile(target: Path) -> bool:
    """Compile the source into target atomically; False when no compiler works."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return False
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "dw_update.c"
        out = Path(tmp) / target.name
        src.write_text(_SOURCE)
        flags = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC"]
        try:
            done = subprocess.run(
                [compiler, *flags, str(src), "-o", str(out)],
                capture_output=True, timeout=120, check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return False
        if done.returncode != 0 or not out.exists():
            return False
        os.replace(out, target)
    return True


def _open(path: Path) -> ctypes.CDLL | None:
    """Load the library and declare the kernel's signature; None if it does not load."""
    try:
        lib = ctypes.CDLL(str(path))
        lib.dw_update.restype = None
        lib.dw_update.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 7]
    except (OSError, AttributeError):
        return None
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None when it cannot be built."""
    if os.environ.get("DEADWEIGHT_NATIVE", "1") == "0" or sys.byteorder != "little":
        return None
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    with _lock:
        if digest in _loaded:
            return _loaded[digest]
        target = _cache_dir() / f"dw_update-{digest}.so"
        lib = _open(target) if target.exists() else None
        if lib is None and _compile(target):  # absent, or unloadable (a foreign or torn file)
            lib = _open(target)
        _loaded[digest] = lib
        return lib


def runs_of(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """(runs, run length, gap) when tensor is evenly spaced contiguous runs, else None.

    A contiguous tensor is one run; a sampled view ``as_strided((runs, len), (gap, 1))`` is
    ``runs`` runs. Anything else is left to the torch kernel.
    """
    if tensor.is_contiguous():
        return 1, tensor.numel(), tensor.numel()
    if tensor.dim() == 2 and tensor.stride(1) == 1:
        return tensor.shape[0], tensor.shape[1], tensor.stride(0)
    return None


class NativePass:
    """Addresses and sizes of the watched tensors, laid out once for the kernel."""

    def __init__(self, lib: ctypes.CDLL, sources: list[torch.Tensor],
                 snapshots: list[torch.Tensor]) -> None:
        self._lib = lib
        self._keep = (sources, snapshots)  # the addresses below stay valid while these live
        count = len(sources)
        table = torch.empty(6, count, dtype=torch.int64)
        for i, (src, snap) in enumerate(zip(sources, snapshots, strict=True)):
            layout = runs_of(src)
            if layout is None or not snap.is_contiguous():
                raise ValueError("the native kernel needs contiguous runs")
            table[0, i] = src.data_ptr()
            table[1, i] = snap.data_ptr()
            table[2, i], table[3, i], table[4, i] = layout
            table[5, i] = DTYPE_CODES[src.dtype]
        self._table = table
        self._count = count
        self.out = torch.zeros(count, FIGURES, dtype=torch.float64)

    @staticmethod
    def supports(sources: list[torch.Tensor]) -> bool:
        """CPU tensors of a known dtype laid out as contiguous runs."""
        return all(
            s.device.type == "cpu" and s.dtype in DTYPE_CODES and runs_of(s) is not None
            for s in sources
        )

    def run(self) -> torch.Tensor:
        """Fill and return the (tensors x 4) figures, refreshing the snapshot on the way."""
        t = self._table
        self._lib.dw_update(
            self._count, t[0].data_ptr(), t[1].data_ptr(), t[2].data_ptr(), t[3].data_ptr(),
            t[4].data_ptr(), t[5].data_ptr(), self.out.data_ptr(),
        )
        return self.out
