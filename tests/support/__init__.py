"""Helpers the tiers share: tiny models, sidecars, raw clients, faults, subprocess entries."""
