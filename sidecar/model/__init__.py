"""What the sidecar knows, as plain data: run state, steps, findings, limits, settings."""
