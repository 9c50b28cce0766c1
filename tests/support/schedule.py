"""How files reach the test workers: each whole on one worker, the longest first.

``.ci/run`` hands work to the workers with ``--dist loadgroup``, one xdist group at a time,
in collection order. Each file is its own group, so its tests run in order on one worker
(some read what earlier ones left), except the files marked ``multiprocess``: they share one
group, so they run one after another on a single worker and never crowd each other (each
starts process groups of its own: torchrun ranks, an image build, timed stress).

A minute-long group collected last leaves a worker idle while it runs alone at the end;
started first, it runs beside the many short files. The list holds the files measured longest
in a clean-clone run (seconds on one worker); the rest keep their collection order. A file
missing from it costs only time, never a result.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    # the fast tiers (unit and contract), run on their own first
    "tests/unit/test_fuzz_registry.py",  # 48: 10,000 fuzzed batches
    "tests/contract/test_alert_rules.py",  # 26: promtool
    "tests/unit/test_stop_agreement.py",  # 8: gloo ranks
    "tests/contract/test_native_wheel.py",  # 5: a wheel built and run
    # the integration and e2e tiers: first the multiprocess group (about 240 s in all)
    "tests/e2e/test_watch.py",  # 133: torchrun, DeepSpeed, FSDP
    "tests/e2e/test_multirank.py",  # 40
    "tests/e2e/test_image.py",  # 23
    "tests/e2e/test_trainer_wrapper.py",  # 18
    "tests/integration/test_trust_measure_race.py",  # 14
    # then the longest files
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


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder items in place: files of LONGEST_FIRST first, in its order; the others after,
    as collected; the tests of one file keep their order."""
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    position = {id(item): index for index, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank)), position[id(item)]

    items.sort(key=key)


#: The one xdist group of the files marked multiprocess.
MULTIPROCESS_GROUP = "multiprocess"


def group_by_file(items: list[pytest.Item]) -> None:
    """Give each test the xdist group of its file, or the multiprocess group (read only under
    ``--dist loadgroup``; a test that names its own group keeps it)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        multiprocess = item.get_closest_marker("multiprocess") is not None
        name = MULTIPROCESS_GROUP if multiprocess else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(name))
