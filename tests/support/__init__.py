"""Helpers the tiers share: tiny models, sidecar processes, raw clients, fault injection, subprocess entry points."""
