"""Real parts together: a real sidecar over a real socket, real trainers, faults, attacks."""
