"""Pure in-process units: detectors, registry, store, probes, kernels; no process of their own."""
