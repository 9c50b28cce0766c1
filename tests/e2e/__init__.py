"""Whole systems: real Prometheus and Alertmanager, the image, torchrun ranks, the demo."""
