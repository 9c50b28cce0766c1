"""Baselines: what a known-good run of a recipe looked like, and a run compared with it.

Every fixed detector encodes one failure someone named; a failure nobody named (a frozen stage
that trains anyway, a ``zero_grad`` left out, a default that changed) passes them all. A
baseline, saved from the sidecar's own history of healthy runs (``deadweight baseline save``),
says what healthy looks like for one recipe: its fingerprint, which module kinds move, and
bands over normalised steps for the figures a run reports. A run that names it (``baseline=``,
``DEADWEIGHT_BASELINE``) sends its content with its RunStart; the ``baseline_*`` detectors
compare the run with it step by step (info while a deviation is young, warning once it
persists), and ``calibrate`` moves a few fixed detectors' thresholds to what healthy runs of
the recipe did, only ever quieter.
"""
