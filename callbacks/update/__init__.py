"""The per-step update measurement: the probe, its stats, its kernels (native, CPU, device)."""
