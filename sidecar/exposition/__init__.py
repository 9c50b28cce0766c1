"""What the sidecar shows: /metrics, its HTTP server, the runbook pages."""
