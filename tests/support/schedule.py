"""The order files reach the two test workers: the longest first.

``.ci/run`` hands whole files to two workers (``--dist loadfile``) in collection order. A
minute-long file collected last leaves one core idle while it runs alone at the end; started
first, it runs beside the many short files. The list holds the files measured longest in a
clean-clone run (seconds on one worker of two); the rest keep their collection order. A file
missing from it costs only time, never a result.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "tests/integration/test_trust_run_id_collision.py",  # 142 s before its go file; 75 after
    "tests/e2e/test_ranks.py",  # 88
    "tests/e2e/test_e2e_short_run.py",  # 80: Alertmanager's group_wait, then the run's expiry
    "tests/integration/test_report.py",  # 75: five trainings, five reports, five screenshots
    "tests/integration/test_enforcement.py",  # 50
    "tests/integration/test_console.py",  # 49
    "tests/e2e/test_wrapper_found.py",  # 43
    "tests/integration/test_trust_metrics_slow.py",  # 32
    "tests/e2e/test_e2e_oncall.py",  # 31
    "tests/e2e/test_newcomer.py",  # 30
    "tests/integration/test_oncall_commands.py",  # 30
    "tests/integration/test_enforcement_restart.py",  # 30
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
