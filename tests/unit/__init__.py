"""Pure in-process units: detectors, registry, store, probes and kernels, no process or socket of their own."""
