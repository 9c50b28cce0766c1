"""Real parts together: a real sidecar over a real socket, real trainers, real faults and attacks."""
