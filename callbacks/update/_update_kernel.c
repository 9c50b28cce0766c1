/* The one-pass CPU kernel of the update measurement, built at install time by setuptools.

   It is loaded with ctypes (no Python or torch headers): the module init below only makes the
   file a well-formed extension module. For every watched tensor it reads the new weights and
   the snapshot once, accumulates the squared update and squared weights in float64, counts the
   elements whose bytes did not change, flags non-finite values, and writes the new weights into
   the snapshot in the same loop, so the snapshot is already fresh for the next step.
   target_clones picks AVX-512/AVX2 code at load time, so one wheel suits every x86-64 CPU. */

/* Python.h first, as it asks; without the headers the file is a plain shared library. */
#if defined(__has_include)
#if __has_include(<Python.h>)
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define DW_HAVE_PYTHON 1
#endif
#endif

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DW_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DW_CLONES
#endif

#if defined(__GNUC__)
#define DW_EXPORT __attribute__((visibility("default")))
#else
#define DW_EXPORT
#endif

/* Figures per tensor: update sq, weight sq, bytes differ, non-finite, unchanged elements. */
#define DW_FIGURES 5

static inline float bf16_to_f(uint32_t b) {
  uint32_t u = b << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline float u32_to_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline double u64_to_d(uint64_t u) { double f; memcpy(&f, &u, 8); return f; }

/* One contiguous run of n elements: accumulate into acc and copy w into s. Non-finite is read
   from the bits (exponent all ones). float32/float64 accumulate in float64; bf16 would be
   compute-bound there, so it sums blocks of 2048 exact float32 products and adds the block
   sums in float64. Equal elements are counted per block in a 32-bit lane counter. */
DW_CLONES static void run_f32(const uint32_t *w, uint32_t *s, int64_t n, double *acc) {
  double du = 0.0, dw = 0.0; uint32_t ch = 0, nf = 0; int64_t same = 0;
  for (int64_t base = 0; base < n; base += 4096) {
    int64_t end = base + 4096 < n ? base + 4096 : n;
    uint32_t eq = 0;
    _Pragma("omp simd reduction(+:du,dw,eq) reduction(|:ch,nf)")
    for (int64_t j = base; j < end; ++j) {
      uint32_t x = w[j], y = s[j]; double a = u32_to_f(x), d = a - (double)u32_to_f(y);
      du += d * d; dw += a * a; ch |= x ^ y; eq += x == y;
      nf |= ((x & 0x7f800000u) + 0x00800000u) | ((y & 0x7f800000u) + 0x00800000u);
      s[j] = x;
    }
    same += eq;
  }
  acc[0] += du; acc[1] += dw; acc[2] += ch != 0; acc[3] += (nf & 0x80000000u) != 0;
  acc[4] += (double)same;
}

DW_CLONES static void run_f64(const uint64_t *w, uint64_t *s, int64_t n, double *acc) {
  const uint64_t e = 0x7ff0000000000000ull, one = 0x0010000000000000ull;
  double du = 0.0, dw = 0.0; uint64_t ch = 0, nf = 0, eq = 0;
  _Pragma("omp simd reduction(+:du,dw,eq) reduction(|:ch,nf)")
  for (int64_t j = 0; j < n; ++j) {
    uint64_t x = w[j], y = s[j]; double a = u64_to_d(x), d = a - u64_to_d(y);
    du += d * d; dw += a * a; ch |= x ^ y; eq += x == y;
    nf |= ((x & e) + one) | ((y & e) + one);
    s[j] = x;
  }
  acc[0] += du; acc[1] += dw; acc[2] += ch != 0; acc[3] += (nf >> 63) != 0;
  acc[4] += (double)eq;
}

DW_CLONES static void run_bf16(const uint16_t *w, uint16_t *s, int64_t n, double *acc) {
  double du = 0.0, dw = 0.0; uint32_t ch = 0, nf = 0; int64_t same = 0;
  for (int64_t base = 0; base < n; base += 2048) {
    int64_t end = base + 2048 < n ? base + 2048 : n;
    float bu = 0.f, bw = 0.f; uint32_t eq = 0;
    _Pragma("omp simd reduction(+:bu,bw,eq) reduction(|:ch,nf)")
    for (int64_t j = base; j < end; ++j) {
      uint32_t x = w[j], y = s[j]; float a = bf16_to_f(x), d = a - bf16_to_f(y);
      bu += d * d; bw += a * a; ch |= x ^ y; eq += x == y;
      nf |= ((x & 0x7f80u) + 0x80u) | ((y & 0x7f80u) + 0x80u);
      s[j] = (uint16_t)x;
    }
    du += bu; dw += bw; same += eq;
  }
  acc[0] += du; acc[1] += dw; acc[2] += ch != 0; acc[3] += (nf & 0x8000u) != 0;
  acc[4] += (double)same;
}

/* The layout version the Python side checks before it calls dw_update. */
DW_EXPORT int64_t dw_abi(void) { return 2; }

/* Measure and refresh every tensor. Tensor i is runs[i] contiguous runs of len[i] elements,
   gap[i] elements apart in the source (one run for a whole tensor, several for a sample),
   packed back to back in its snapshot. out[DW_FIGURES i ...] gets its figures. */
DW_EXPORT void dw_update(int64_t count, const int64_t *src, const int64_t *snap,
                         const int64_t *runs, const int64_t *len, const int64_t *gap,
                         const int64_t *dtype, double *out) {
  for (int64_t i = 0; i < count; ++i) {
    double *o = out + DW_FIGURES * i;
    for (int k = 0; k < DW_FIGURES; ++k) o[k] = 0.0;
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

/* A well-formed (empty) extension module, so importers accept the file; the kernel itself is
   reached through ctypes. */
#ifdef DW_HAVE_PYTHON
static struct PyModuleDef dw_module = {
  PyModuleDef_HEAD_INIT, "_update_kernel",
  "Native update-pass kernel; loaded with ctypes by deadweight.callbacks.update_native.",
  0, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__update_kernel(void) { return PyModuleDef_Init(&dw_module); }
#endif
