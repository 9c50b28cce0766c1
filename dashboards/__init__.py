"""Grafana dashboards built as code; the committed JSON is their output."""
