"""``frozen_weights`` judges a step by what its own optimizer would have moved.

Real raw loops under ``deadweight.watch`` with every optimizer family: healthy plain SGD,
momentum SGD, Adafactor (torch's and transformers', with a rate or its own relative step
size), a Lion update and AdamW stay silent;
the same loops with the optimizer built over a copy of the model (nothing moves) fire.
The healthy SGD runs are the false page the Adam-only ratio gave: their Adam-like ratio
``update_L2/(lr·√n)`` sits below the floor while every weight moves.
"""

from __future__ import annotations

import pytest

from deadweight.sidecar.detectors import optimizer_family
from tests.support import loops
from tests.support.inprocess_sidecar import InProcessSidecar

FAMILIES = {"sgd": "sgd", "sgd-momentum": "sgd", "adafactor-torch": "adafactor",
            "adafactor-transformers": "adafactor", "adafactor-relative": "adafactor",
            "lion": "adam", "adamw": "adam"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_healthy_loop_of_every_family_stays_silent(name: str, live: InProcessSidecar) -> None:
    run_id = f"family-healthy-{name}"
    loops.run_loop(live, run_id, name)
    loops.wait_ended(live, run_id)
    run = live.seen(run_id)
    assert optimizer_family.family(run.start.config_text) == FAMILIES[name]  # type: ignore[union-attr]
    steps = run.combined_steps()
    assert len(steps) == 12 and all(p.grad_sq_sum and p.grad_sq_sum > 0 for p in steps)
    assert all(p.unchanged_tensors == 0 for p in steps)  # every weight moved at every step
    fired = live.fired(run_id)
    assert "frozen_weights" not in fired, fired["frozen_weights"].summary
    floor = live.registry.settings.frozen_ratio_floor
    if name.startswith("sgd"):  # the Adam-only ratio would have paged this run at step 3
        assert all((p.update_ratio or 0.0) < floor for p in steps[:3])
    ratios = [optimizer_family.step_ratio(p, FAMILIES[name]) for p in steps]
    assert min(r or 0.0 for r in ratios) > 10 * floor


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_frozen_loop_of_every_family_fires(name: str, live: InProcessSidecar) -> None:
    run_id = f"family-frozen-{name}"
    loops.run_loop(live, run_id, name, frozen=True)
    loops.wait_ended(live, run_id)
    frozen = live.fired(run_id)["frozen_weights"]
    assert frozen.evidence["update_norm"] == "0"
    assert frozen.step == live.registry.settings.frozen_steps  # the third optimizer step
