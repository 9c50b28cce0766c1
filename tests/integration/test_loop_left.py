"""A Trainer loop that raises and a process that lives on (Ctrl-C in a notebook cell, an
exception a script catches): the run ends as ``failed`` at its last step, with no verdict, and
a new ``train()`` is a new life of the run id. A loop that pauses inside (a long step) is never
taken for one that left. Real SFT runs on the tiny model, heartbeats every 0.2 s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from deadweight.callbacks.stream_client import ClientSettings
from deadweight.demo import runs
from deadweight.sidecar.model.nonces import Attestor
from deadweight.sidecar.registry import Registry
from tests.support.healthy_recipes import console
from tests.support.inprocess_sidecar import TEST_SETTINGS, InProcessSidecar
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

#: Heartbeats often, so the loop's absence is found within about a second.
FAST_BEATS = ClientSettings(heartbeat_seconds=0.2)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSidecar]:
    # stall windows far beyond the test: a stall verdict cannot race the run's end
    settings = replace(TEST_SETTINGS, stalled_seconds=120.0, stalled_step_seconds=120.0)
    sidecar = InProcessSidecar(tmp_path_factory.mktemp("left") / "dw.sock", registry=Registry(
        settings=settings, attestor=Attestor())).start()
    yield sidecar
    sidecar.stop()


class Interrupt(TrainerCallback):  # type: ignore[misc]
    """Ctrl-C at a step's end, once."""

    def __init__(self, at: int) -> None:
        self.at, self.done = at, False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at and not self.done:
            self.done = True
            raise KeyboardInterrupt


class Pause(TrainerCallback):  # type: ignore[misc]
    """A long step: seconds inside the loop, many heartbeats, nothing submitted."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            time.sleep(2.0)


def _trainer(live: InProcessSidecar, tiny: tuple[Path, Path], out: Path, run_id: str,
             extra: TrainerCallback) -> Any:
    model_dir, _ = tiny
    from transformers import AutoModelForCausalLM

    return runs.sft_trainer(AutoModelForCausalLM.from_pretrained(model_dir), model_dir, out,
                            [live.callback(run_id, settings=FAST_BEATS), extra], steps=6,
                            save_steps=10, peft_config=runs.lora_config())


def test_a_loop_that_raised_ends_its_run_as_failed_with_no_verdict(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    trainer = _trainer(live, tiny, tmp_path, "interrupted", Interrupt(at=3))
    with console() as shown:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        # the process lives on, as a notebook's kernel does
        wait_for(lambda: live.seen("interrupted").ended, 30, what="the run ended by the sender")
    run = live.seen("interrupted")
    assert (run.end_reason, run.step) == ("failed", 3)
    assert live.fired("interrupted") == {}
    assert any("run interrupted ended (failed) at step 3; no verdict" in line
               for line in shown.lines), shown.lines


def test_a_new_train_call_after_an_interrupt_is_a_new_life_of_the_run(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    trainer = _trainer(live, tiny, tmp_path, "rerun", Interrupt(at=2))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    trainer.train()  # at once, before the sender looked
    run = wait_for(lambda: (r := live.seen("rerun")).ended and r.incarnation == 2 and r, 30,
                   what="the second life's end")
    assert (run.end_reason, run.step) == ("completed", 6)
    assert live.fired("rerun") == {}


def test_a_long_pause_inside_the_loop_is_not_an_exit(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    trainer = _trainer(live, tiny, tmp_path, "paused", Pause())
    trainer.train()
    run = wait_for(lambda: (r := live.seen("paused")).ended and r, 30, what="the run's end")
    assert (run.end_reason, run.step, run.incarnation) == ("completed", 6, 1)
    assert live.fired("paused") == {}
