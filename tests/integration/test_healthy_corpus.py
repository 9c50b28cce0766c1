"""The healthy corpus: the recipes users really run, each on a tiny local model, must end with
no warning or critical verdict and nothing on the trainer's console but deadweight's begin and
end lines.

Every recipe of ``tests.support.healthy_recipes.RECIPES`` runs in this process against one
in-process sidecar with the failure tests' short windows and a stall window of seconds (as
the healthy matrix of ``test_catalogue_healthy`` does), so a detector that fires wrongly on any
of them fails that recipe's test, which names each detector with its severity, step and
evidence. The multi-process recipes (DDP, FSDP2, a busy machine) are in
``tests/e2e/test_healthy_corpus_ranks.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.healthy_recipes import (
    RECIPES,
    Kit,
    console,
    corpus_sidecar,
    verdicts_and_noise,
)
from tests.support.inprocess_sidecar import InProcessSidecar

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSidecar]:
    sidecar = corpus_sidecar(tmp_path_factory.mktemp("corpus"))
    yield sidecar
    sidecar.stop()


@pytest.mark.parametrize("name", list(RECIPES))
def test_healthy_recipe_ends_without_a_verdict_or_a_console_line(
    name: str, live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    recipe = RECIPES[name]
    model_dir, adapter_dir = tiny
    with console() as shown:
        ran = recipe.train(Kit(live, model_dir, adapter_dir, tmp_path))
    assert ran and all(steps > 0 for _, steps in ran)
    problems = verdicts_and_noise(live, ran, shown.lines, recipe.allowed)
    assert problems == [], "\n".join(problems)
