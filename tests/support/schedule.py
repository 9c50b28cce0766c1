"""How files reach the test workers: each whole on one worker, the longest first.

``.ci/run`` hands work to the workers with ``--dist loadfile --no-loadscope-reorder``, one
unit at a time, in collection order (xdist's default reorder, by test count, is turned off).
Each file is one unit, so its tests run in order on one worker (some read what earlier ones
left), except the files marked ``multiprocess``: they are one unit together
(``FileScheduling``), so they run one after another on a single worker and never crowd each
other (each starts process groups of its own: torchrun ranks, an image build, timed stress).

A minute-long group collected last leaves a worker idle while it runs alone at the end;
started first, it runs beside the many short files. The list holds the files measured longest
in a clean-clone run (seconds on one worker); the rest keep their collection order. A file
missing from it costs only time, never a result.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling

#: The files marked ``multiprocess`` (each with a module-level ``pytestmark``): one work unit
#: under ``--dist loadfile``. The xdist controller sees node ids only, not marks, so the list
#: is kept here; ``check_multiprocess_marks`` fails a session where the two disagree. The
#: unit is the longest (seconds alone, before its launches were shared: 133, 40, 23, 18, 14;
#: test_watch now 56), so it goes first.
MULTIPROCESS_FILES = frozenset({
    "tests/e2e/test_watch.py",  # torchrun, DeepSpeed, FSDP
    "tests/e2e/test_multirank.py",
    "tests/e2e/test_image.py",
    "tests/e2e/test_trainer_wrapper.py",
    "tests/integration/test_trust_measure_race.py",
    "tests/integration/test_healthy_corpus_ranks.py",  # torchrun, a CPU hog
})
MULTIPROCESS_UNIT = "multiprocess"

LONGEST_FIRST = (
    # the fast tiers (unit and contract), first after the multiprocess unit
    "tests/unit/test_fuzz_registry.py",  # 48: 10,000 fuzzed batches
    "tests/contract/test_alert_rules.py",  # 26: promtool
    "tests/unit/test_stop_agreement.py",  # 8: gloo ranks
    "tests/contract/test_native_wheel.py",  # 5: a wheel built and run
    # the integration and e2e tiers, after the fast ones (the multiprocess unit,
    # MULTIPROCESS_FILES, always first: 240 s alone, 430 s beside the other three workers)
    "tests/integration/test_console.py",  # 80
    "tests/e2e/test_e2e_short_run.py",  # 73: Alertmanager's group_wait, then the run's expiry
    "tests/e2e/test_ranks.py",  # 52
    "tests/integration/test_trust_run_id_collision.py",  # 41: two jobs, one run id
    "tests/e2e/test_e2e_oncall.py",  # 33
    "tests/integration/test_oncall_stop_restart.py",  # 32
    "tests/integration/test_trust_memory.py",  # 31: the sidecar driven to every cap
    "tests/integration/test_trust_metrics_slow.py",  # 30
    "tests/integration/test_silent_failures.py",  # 28
    "tests/e2e/test_newcomer.py",  # 26
    "tests/integration/test_catalogue_failures.py",  # 25
    "tests/integration/test_report.py",  # 25: five trainings, five reports, five screenshots
    "tests/integration/test_oncall_commands.py",  # 21
    "tests/integration/test_catalogue_healthy.py",  # 20
    "tests/e2e/test_wrapper_found.py",  # 20
    "tests/integration/test_trust_runs.py",  # 20
    "tests/integration/test_enforcement.py",  # 19
)


#: The tiers that must fail fast: their files start right after the multiprocess unit, before
#: every integration and e2e file (``.ci/run`` stops the session at their first failure).
FAST_TIERS = ("tests/unit/", "tests/contract/")


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder items in place: the multiprocess files first, then the fast tiers, then the
    rest; within each, the files of LONGEST_FIRST in its order, the others after, as
    collected; the tests of one file keep their order."""
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    position = {id(item): index for index, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int, int]:
        path = item.nodeid.split("::", 1)[0]
        tier = 0 if path in MULTIPROCESS_FILES else 1 if path.startswith(FAST_TIERS) else 2
        return tier, rank.get(path, len(rank)), position[id(item)]

    items.sort(key=key)


class FileScheduling(LoadFileScheduling):
    """``--dist loadfile`` with one change: the multiprocess files are one work unit, so
    they run one after another on a single worker, beside the other files."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return MULTIPROCESS_UNIT if path in MULTIPROCESS_FILES else path


def check_multiprocess_marks(items: list[pytest.Item]) -> None:
    """Refuse a session where a file's ``multiprocess`` mark and MULTIPROCESS_FILES disagree
    (a marked file missing from the list would run beside the others and crowd them)."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        marked = item.get_closest_marker("multiprocess") is not None
        if marked != (path in MULTIPROCESS_FILES):
            where = "is marked multiprocess but is not" if marked else "is not marked but is"
            raise pytest.UsageError(
                f"{item.nodeid} {where} in tests/support/schedule.py MULTIPROCESS_FILES "
                "(mark the whole file, and list it there)"
            )
