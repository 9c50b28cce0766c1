"""Full fine-tuning: the sampled mode's memory and cost against a full snapshot.

Every weight of a Qwen3-0.6B-shaped model (596M parameters in bf16, 1.2 GB) is watched, as in
full fine-tuning. Above ``max_full_elements`` (default 200M) the probe keeps a fixed strided
sample of 4096 elements per tensor instead of a full copy, so its memory no longer grows with
the model.
"""

from __future__ import annotations

import statistics
import time

import torch

from deadweight.callbacks.update.probe import UpdateProbe

from .common import flush_cache, fmt_time, table

VOCAB = 151_936


def full_model_shapes(layers: int) -> list[tuple[int, ...]]:
    """Every weight of a Qwen3-0.6B-shaped decoder (tied embedding, RMSNorm weights)."""
    h, i, q, kv, hd = 1024, 3072, 2048, 1024, 128
    shapes: list[tuple[int, ...]] = [(VOCAB, h)]
    for _ in range(layers):
        shapes += [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (hd,), (hd,),
                   (h,), (h,)]
    return [*shapes, (h,)]


def _step_cost(probe: UpdateProbe, tensors: list[torch.Tensor], repeats: int) -> list[float]:
    """before_step + after_step seconds around a simulated step that moves every weight."""
    probe.before_step()
    torch._foreach_add_(tensors, 1e-2)
    probe.after_step()
    times = []
    for _ in range(repeats):
        flush_cache()
        start = time.perf_counter()
        probe.before_step()
        pre = time.perf_counter() - start
        torch._foreach_add_(tensors, 1e-2)
        flush_cache()
        start = time.perf_counter()
        stats = probe.after_step()
        times.append(pre + time.perf_counter() - start)
        assert stats is not None and stats.unchanged_tensors == 0
    return times


def run(bandwidth: float, repeats: int, quick: bool) -> list[list[str]]:
    """Sampled vs full snapshot on every weight of the model."""
    layers = 8 if quick else 28
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen, dtype=torch.bfloat16)
               for s in full_model_shapes(layers)]
    n = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rows = []
    for label, limit in (("sampled (default above 200M)", 1), ("full snapshot", n + 1)):
        probe = UpdateProbe(tensors, max_full_elements=limit, background=False)
        times = _step_cost(probe, tensors, max(3, repeats // 2))
        rows.append([label, probe.path, f"{probe.snapshot_bytes / 2**20:.1f} MiB",
                     f"{probe.snapshot_bytes / nbytes:.4%}", fmt_time(min(times)),
                     fmt_time(statistics.median(times)),
                     fmt_time(3 * nbytes / bandwidth)])
        del probe
    table(f"full fine-tuning: {n / 1e6:.0f}M bf16 weights in {len(tensors)} tensors "
          f"({layers} layers), per-step probe cost and snapshot memory",
          ["mode", "kernel", "snapshot", "of weights", "best", "median",
           "full-pass bound"], rows)
    return rows
