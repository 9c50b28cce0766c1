"""The /metrics renderer says exactly what the client library's encoder says, faster."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deadweight.sidecar.metrics_http import MetricsServer, render


class _Awkward(Collector):
    """Families with every value and label the text format has to escape or spell out."""

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("dw_gauge", 'help with "quotes" \\ and\nnewline',
                                  labels=["trainer", "run_id"])  # not in sorted order
        gauge.add_metric(["T", 'run "a"\\b\nc'], 1.5)
        gauge.add_metric(["T", "nan"], math.nan)
        gauge.add_metric(["T", "inf"], math.inf)
        gauge.add_metric(["T", "-inf"], -math.inf)
        gauge.add_metric(["T", "tiny"], 1e-300)
        gauge.add_metric(["T", "int"], 3.0)
        yield gauge
        counter = CounterMetricFamily("dw_events", "a counter", labels=["rank"])
        counter.add_metric(["0"], 7.0)
        yield counter
        bare = GaugeMetricFamily("dw_bare", "no labels", value=2.0)
        yield bare


def test_render_matches_the_client_library_byte_for_byte() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Awkward())
    assert render(_Awkward().collect()) == generate_latest(registry)


def test_server_answers_metrics_and_404_elsewhere() -> None:
    server = MetricsServer("127.0.0.1", 0, _Awkward().collect)
    try:
        url = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert b"dw_events_total" in response.read()
        try:
            urllib.request.urlopen(f"{url}/nope", timeout=5)
            raise AssertionError("expected 404")
        except urllib.error.HTTPError as err:
            assert err.code == 404
    finally:
        server.stop()
