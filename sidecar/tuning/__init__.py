"""Process tuning for the sidecar: CPU pinning, garbage-collector settings."""
