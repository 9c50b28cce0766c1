"""Alert rules, their tests and the Alertmanager example, generated from one table."""
