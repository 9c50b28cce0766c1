"""A constant GRPO reward is named as the cause, first, with its own fix, wherever a person reads.

A real GRPOTrainer on the tiny model with a reward function that gives every completion the
same value: the advantages are 0, so the gradient is 0 and the adapter never moves. Its
verdicts follow from that one fault (``zero_reward_variance``), and the causal graph
(``symptom_of``) puts it before every symptom: the trainer's console summary, ``deadweight
status`` (text and JSON), the report's headline with its fix, and the run summary beside the
adapter all lead with it, never with ``zero_gradient``'s fix for a detached SFT loss. The
healthy twin (a reward that depends on the completion) names no cause at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo import runs
from deadweight.sidecar.commands import report, status, status_json
from deadweight.sidecar.detectors import GRAPH, fix_sentence
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import Store
from tests.support.inprocess_sidecar import TEST_SETTINGS, InProcessSidecar

pytestmark = pytest.mark.slow

CAUSE = "zero_reward_variance"


def constant_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0 for _ in completions]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessSidecar, Store]]:
    """A sidecar with a state database (the report reads it), the failure tests' windows."""
    folder = tmp_path_factory.mktemp("reward")
    store = Store(folder / "state")
    sidecar = InProcessSidecar(folder / "deadweight.sock",
                               Registry(settings=TEST_SETTINGS, store=store),
                               checkpoint_settle_seconds=0.5).start()
    yield sidecar, store
    sidecar.stop()


def _base(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def test_a_constant_reward_is_the_root_cause_everywhere_it_is_read(
        live: tuple[InProcessSidecar, Store], tiny: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    sidecar, store = live
    model_dir, _ = tiny
    out = tmp_path / "const"
    runs.grpo_trainer(_base(model_dir), model_dir, out, [sidecar.callback("grpo-const")],
                      beta=0.0, steps=5, save_steps=5, reward_funcs=constant_reward,
                      peft_config=runs.lora_config()).train()
    sidecar.wait_inspected("grpo-const", 1)
    fired = set(sidecar.fired("grpo-const"))
    symptoms = fired & set(GRAPH.symptoms_of(CAUSE))
    assert CAUSE in fired and "zero_gradient" in symptoms, fired
    console = capsys.readouterr().err

    # The console's summary at train end: the cause first.
    [summary] = [line for line in console.splitlines()
                 if line.startswith("deadweight: run grpo-const ended")]
    assert summary.split("root cause first: ")[1].startswith(f"{CAUSE} ("), summary
    # Its own verdict line carries its fix (the reward's, not a detached loss's).
    [line] = [line for line in console.splitlines() if f"deadweight CRITICAL {CAUSE} " in line
              or f"deadweight WARNING {CAUSE} " in line]
    assert fix_sentence(CAUSE).rstrip(".") in line

    # deadweight status, text and JSON: the cause leads the run's verdicts.
    answer = sidecar.registry.status("grpo-const")
    text = status.render(answer)
    assert text.index(CAUSE) < min(text.index(s) for s in symptoms)
    document = json.loads(status_json.dumps(answer))
    assert document["runs"][0]["findings"][0]["detector"] == CAUSE

    # The report's headline: the cause and its fix, the symptoms after it.
    top = report.headline(report.load(store, "grpo-const"))
    assert top.root is not None and top.root.detector == CAUSE
    assert top.fix == fix_sentence(CAUSE)
    assert {i.detector for i in top.others} >= symptoms - {CAUSE}

    # The run summary beside the adapter: its verdicts lead with the cause.
    written = json.loads((out / "deadweight-summary.json").read_text())["summary"]
    assert written["verdicts"][0]["detector"] == CAUSE, written["verdicts"]


def test_a_reward_with_spread_names_no_cause(
        live: tuple[InProcessSidecar, Store], tiny: tuple[Path, Path], tmp_path: Path) -> None:
    sidecar, _ = live
    model_dir, _ = tiny
    runs.grpo_trainer(_base(model_dir), model_dir, tmp_path / "spread",
                      [sidecar.callback("grpo-spread")], beta=0.0, steps=5, save_steps=5,
                      peft_config=runs.lora_config(), **runs.terminating(model_dir)).train()
    sidecar.wait_inspected("grpo-spread", 1)
    fired = set(sidecar.fired("grpo-spread")) - {"no_kl_anchor"}  # information, beta 0
    assert not fired & ({CAUSE} | set(GRAPH.symptoms_of(CAUSE))), fired
