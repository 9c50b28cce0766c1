"""The Trainer reports the wrapper that really runs, so a silent fallback is visible.

On CPU, a Trainer config asking for FSDP2 (``fsdp="full_shard"``, ``fsdp_config.version=2``)
trains under DDP without a word: accelerate wraps the model in ``DistributedDataParallel``.
The callback reports the wrapper it finds on the objects next to the one the config asked
for; the sidecar turns a mismatch into the ``sharding_fallback`` finding (info), visible in
``deadweight status`` and ``/metrics``. The control is the same job without the FSDP config,
run after it in the same launch.
Real ``torchrun --nproc-per-node 2`` jobs (gloo) and a real ``deadweight serve``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from tests.conftest import firing_values
from tests.e2e.test_multirank import _torchrun_runs

# torchrun ranks take both cores: these files run one after another, never beside each other
# (tests/support/schedule.py MULTIPROCESS_FILES)
pytestmark = pytest.mark.multiprocess

FSDP2_CONFIG = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}


CONFIGS = {"fsdp2": FSDP2_CONFIG, "none": {}}


@pytest.fixture(scope="module")
def jobs(sidecar: SidecarProcess, tiny: tuple[Path, Path],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Per config: its healthy job's rank reports, both jobs run one after the other in one
    launch."""
    runs = _torchrun_runs(sidecar, tiny, tmp_path_factory.mktemp("configs"),
                          [("healthy", overrides) for overrides in CONFIGS.values()], 2)
    return dict(zip(CONFIGS, runs, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp_config_that_fell_back_to_ddp_is_visible(
    config: str, sidecar: SidecarProcess, jobs: dict[str, list[dict[str, Any]]]
) -> None:
    reports = jobs[config]
    assert {(r["wrapper"], r["sharded"]) for r in reports} == {("ddp", False)}
    run_id = reports[0]["run_id"]
    run = sidecar.run_status(run_id)
    assert run is not None and sorted(run.ranks) == [0, 1] and run.step == 2
    assert (run.wrapper, run.sharded) == ("ddp", False)
    findings = {f.detector: f for f in run.findings}
    firing = firing_values(sidecar.metrics(), run_id)
    if config == "fsdp2":
        fallback = findings["sharding_fallback"]
        assert fallback.severity == "info" and fallback.firing
        assert (fallback.evidence["requested_wrapper"], fallback.evidence["wrapper"]) == (
            "fsdp2", "ddp")
        assert firing["sharding_fallback"] == 1.0
        assert set(findings) == {"sharding_fallback"}  # nothing else: the run is healthy
    else:
        assert findings == {}, {k: f.summary for k, f in findings.items()}
        assert firing["sharding_fallback"] == 0.0
