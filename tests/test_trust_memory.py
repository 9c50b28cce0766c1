"""The manifest's memory limit holds the worst case its caps allow, measured on a real sidecar.

``bench/sidecar_memory.py`` starts a real ``deadweight serve`` with the manifest's
memory-relevant flags and drives it to every cap at once (runs, ranks, steps, adapter
groups, log keys and values, checkpoint reports, the largest checkpoint header under the watch
root, Status and /metrics); its peak RSS (``VmHWM``) must stay under the manifest's
``limits.memory``, and one rank beyond ``--max-ranks`` must be refused. Memory, not time, is
asserted: the run takes about 40 s here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import sidecar_memory

pytestmark = pytest.mark.slow


def test_peak_memory_at_every_cap_stays_under_the_manifest_limit(tmp_path: Path) -> None:
    found = sidecar_memory.manifest()
    assert set(found.flags) == set(sidecar_memory.MEMORY_FLAGS), found.flags
    shape = sidecar_memory.Shape.worst(found.flags["--max-runs"], found.flags["--max-ranks"])
    result = sidecar_memory.measure(tmp_path, found.flags, shape)
    # Every run's largest header was inspected, and the rank cap is what bounds the ranks.
    assert result.inspected >= shape.runs
    assert result.refused_rank == f"sidecar already holds {shape.ranks} ranks"
    # The workload really loaded the sidecar: far above an idle one.
    assert result.peak_bytes > result.idle_peak_bytes + 256 * sidecar_memory.MIB
    assert result.peak_bytes <= found.limit_bytes, (
        f"peak {result.peak_bytes / sidecar_memory.MIB:.0f} MiB over the manifest's "
        f"limit {found.limit_bytes / sidecar_memory.MIB:.0f} MiB")
    assert found.request_bytes < found.limit_bytes
