"""The /metrics renderer says exactly what the client library's encoder says, faster."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deadweight.proto import pb
from deadweight.sidecar.exporter import DeadweightCollector
from deadweight.sidecar.metrics_http import MetricsServer, render
from deadweight.sidecar.registry import Registry


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


def _steps(run_id: str, first: int, count: int, moved: bool) -> pb.StreamRequest:
    events = [pb.Event(seq=step, step=pb.StepReport(
        step=step, learning_rate=1e-4, update_sq_sum=1e-6 if moved else 0.0, param_sq_sum=1.0,
        watched_tensors=4, watched_params=1000, optimizer_params=1000,
        unchanged_tensors=0 if moved else 4)) for step in range(first, first + count)]
    # the trainer's log: a finite loss and a flowing gradient (frozen weights then fire)
    events.append(pb.Event(seq=first + count, log=pb.LogReport(
        step=first + count - 1, values={"loss": 1.0, "grad_norm": 0.5})))
    return pb.StreamRequest(run_id=run_id, events=events)


def test_the_sidecar_page_matches_the_client_library_as_verdicts_come_and_go() -> None:
    # /metrics writes the detector-firing family from cached per-run blocks: the page must
    # stay byte-identical to the library's encoding of the same collector, scrape after scrape.
    registry = Registry()
    collector = DeadweightCollector(registry, None, registry.detectors)
    library = CollectorRegistry(auto_describe=False)
    library.register(collector)
    run_ids = ["healthy", 'odd "run"\\id', "frozen"]
    for run_id in run_ids:
        start = pb.RunStart(trainer="SFTTrainer", config={"learning_rate": 1e-4})
        assert not registry.ingest(pb.StreamRequest(
            run_id=run_id, events=[pb.Event(seq=0, run_start=start)])).error
    pages = []
    for first, count in ((1, 2), (4, 40)):
        for run_id in run_ids:
            assert not registry.ingest(_steps(run_id, first, count, run_id != "frozen")).error
        page = render(collector.exposition())
        assert page == generate_latest(library)
        pages.append(page.decode())
    firing = [{line for line in page.splitlines()
               if line.startswith("deadweight_detector_firing{") and line.endswith(" 1.0")}
              for page in pages]
    came = firing[1] - firing[0]  # a verdict came: the run's cached block was replaced
    assert came and all('run_id="frozen"' in line for line in came)
    assert 'run_id="odd \\"run\\"\\\\id"' in pages[1]
