"""Stop the whole session, every xdist worker, at the first failure in the fast tiers.

``.ci/run`` runs every tier in one xdist session (one start and one collection per worker
instead of two) and still fails fast: ``--stop-at-failure-in tests/unit`` (repeatable) makes
the first failing test under that folder stop its worker and leave a flag file that every
other worker reads after each test, so the session ends a test later everywhere (xdist's own
``-x`` would wait for each worker to drain the files already handed to it). A failure in any
other folder stops nothing, so a slow tier reports all its failures at once.

A pytest plugin (``tests/conftest.py`` loads it). The controller names the flag file and
hands it to the workers (``pytest_configure_node``); without xdist the session itself stops
(as ``-x`` does, for those folders only).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

OPTION = "--stop-at-failure-in"
FLAG = pytest.StashKey[Path]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION, action="append", default=[], metavar="FOLDER",
        help="stop the whole session (every xdist worker) at the first failure of a test "
             "under FOLDER; repeatable")


def _folders(config: pytest.Config) -> list[str]:
    return [folder.rstrip("/") + "/" for folder in config.getoption(OPTION)]


def pytest_configure(config: pytest.Config) -> None:
    """Where the flag lives: named by the controller (or a session without workers)."""
    if not _folders(config):
        return
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None:
        config.stash[FLAG] = Path(workerinput["fail_fast_flag"])
    else:
        config.stash[FLAG] = Path(tempfile.mkdtemp(prefix="fail-fast-")) / "failed"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """The controller hands its flag's path to each worker it starts."""
    flag = node.config.stash.get(FLAG, None)
    if flag is not None:
        node.workerinput["fail_fast_flag"] = str(flag)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failure under one of the folders raises the flag and stops this worker."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    flag = item.config.stash.get(FLAG, None)
    if flag is None or not report.failed:
        return
    if any(report.nodeid.startswith(folder) for folder in _folders(item.config)):
        flag.write_text(report.nodeid)
        item.session.shouldstop = f"{report.nodeid} failed ({OPTION})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After each test: another worker's fast-tier failure stops this one too."""
    yield
    flag = item.config.stash.get(FLAG, None)
    if flag is not None and not item.session.shouldstop and flag.exists():
        item.session.shouldstop = f"{flag.read_text()} failed on another worker ({OPTION})"
