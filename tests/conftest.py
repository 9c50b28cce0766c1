"""Shared fixtures: tiny local models, real sidecar processes, and a /metrics probe callback.

Nothing is downloaded (``HF_HUB_OFFLINE=1``); torch runs on one thread so the suite behaves
the same on a loaded two-core machine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from deadweight.demo.sidecar_process import SidecarProcess

#: ``--stop-at-failure-in FOLDER``: the fast tiers stop every worker at their first failure.
pytest_plugins = ["tests.support.fail_fast"]

FIRING = re.compile(
    r'^deadweight_detector_firing\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.MULTILINE
)


def firing_values(metrics_text: str, run_id: str) -> dict[str, float]:
    """detector -> deadweight_detector_firing value for run_id in a /metrics page."""
    found: dict[str, float] = {}
    for match in FIRING.finditer(metrics_text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
        if labels.get("run_id") == run_id:
            found[labels["detector"]] = float(match["value"])
    return found


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model_dir, adapter_dir): a tiny Qwen2-style model and a saved LoRA adapter."""
    from deadweight.demo import runs

    return runs.prepare(tmp_path_factory.mktemp("models"), "qwen2")


@pytest.fixture(scope="session")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    """A real ``deadweight serve`` with default policies, shared by the session."""
    with SidecarProcess(tmp_path_factory.mktemp("sidecar")) as process:
        yield process


@pytest.fixture(scope="session")
def stopping_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    """A real sidecar whose policy stops frozen runs."""
    folder = tmp_path_factory.mktemp("sidecar-stop")
    with SidecarProcess(folder, policies={"frozen_weights": "stop"}) as process:
        yield process


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An in-process sidecar (real gRPC on a unix socket) whose findings a test reads directly."""
    from tests.support.inprocess_sidecar import InProcessSidecar

    sidecar = InProcessSidecar.live(tmp_path_factory.mktemp("live"))
    yield sidecar
    sidecar.stop()


class MetricsProbe:
    """A TrainerCallback that scrapes /metrics at every step end and keeps each detector's max.

    It shows what Prometheus would have seen while the run was live (verdicts resolve when
    the run ends).
    """

    def __init__(self, sidecar: SidecarProcess, run_id: str) -> None:
        from transformers import TrainerCallback

        self.sidecar = sidecar
        self.run_id = run_id
        self.max_firing: dict[str, float] = {}
        self.callback = type("Probe", (TrainerCallback,), {"on_step_end": self._on_step_end})()

    def _on_step_end(self, *args: Any, **kwargs: Any) -> None:
        for detector, value in firing_values(self.sidecar.metrics(), self.run_id).items():
            self.max_firing[detector] = max(value, self.max_firing.get(detector, 0.0))


#: Programs the tests drive for real; .ci/run installs them. Missing ones fail the session
#: up front with one clear message instead of letting tests skip themselves into green.
REQUIRED_PROGRAMS = (
    "prometheus", "promtool", "prometheus-alertmanager", "amtool", "openssl", "gcc", "buildah",
    "debootstrap", "ip", "chromium",
)


#: The seed of this session's property-based tests (fresh each run unless given).
FUZZ_SEED = pytest.StashKey[object]()


def pytest_configure(config: pytest.Config) -> None:
    """Every run fuzzes with a fresh seed; ``--hypothesis-seed=N`` replays run N exactly."""
    from hypothesis import core

    seed = config.getoption("hypothesis_seed", None)
    if seed is None:
        import secrets

        seed = secrets.randbelow(2**32)
        core.global_force_seed = seed
    config.stash[FUZZ_SEED] = seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failing property-based test names the seed that reproduces its run."""
    outcome = yield
    report = outcome.get_result()
    module = getattr(item, "module", None)
    fuzzed = any(getattr(v, "__module__", "").startswith("hypothesis")
                 for v in vars(module).values()) if module is not None else False
    if report.failed and fuzzed:
        seed = item.config.stash.get(FUZZ_SEED, None)
        report.sections.append(("hypothesis seed", f"rerun with --hypothesis-seed={seed}"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first, so the workers finish together (``support.schedule``)."""
    from tests.support.schedule import check_multiprocess_marks, longest_first

    check_multiprocess_marks(items)
    longest_first(items)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadfile``: whole files, the multiprocess files as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.support.schedule import FileScheduling

    return FileScheduling(config, log)


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis seed: {config.stash.get(FUZZ_SEED, None)} (--hypothesis-seed to replay)"


def pytest_sessionstart(session: pytest.Session) -> None:
    import shutil

    missing = [name for name in REQUIRED_PROGRAMS if shutil.which(name) is None]
    if missing:
        raise pytest.UsageError(
            f"programs the tests need are not installed: {', '.join(missing)} "
            "(run `bash .ci/run`, which installs them)"
        )
