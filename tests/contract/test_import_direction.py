"""The two sides stay apart, and every module has one import name.

``lint-imports`` (contracts in pyproject.toml) checks the static imports; the runtime checks
below load the sidecar the way its image does, without the training side, the demo or torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_names import BARE_NAMES, ROOT, bare_modules_loaded

#: What the sidecar image lacks: the training side, the demo and the training stack.
ABSENT_IN_IMAGE = ("deadweight.callbacks", "deadweight.demo", "torch", "transformers", "trl",
                   "peft", "datasets", "accelerate")


def _python(script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), "import-linter is not installed (the dev extra has it)"
    result = subprocess.run([str(lint_imports), "--no-cache", "--no-logo"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_every_sidecar_module_loads_without_the_training_side_or_the_demo() -> None:
    script = (
        "import importlib, pkgutil, sys\n"
        f"for name in {ABSENT_IN_IMAGE!r}:\n"
        "    sys.modules[name] = None  # importing it now raises ModuleNotFoundError\n"
        "import deadweight.proto.transport, deadweight.sidecar as s\n"
        "names = [m.name for m in pkgutil.walk_packages(s.__path__, 'deadweight.sidecar.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names))\n"
    )
    result = _python(script)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 10  # the walk found the sidecar's modules


@pytest.mark.parametrize("bare", sorted(BARE_NAMES))
def test_a_bare_folder_name_is_refused_under_pytest(bare: str) -> None:
    with pytest.raises(ImportError, match=f"deadweight.{bare}"):
        __import__(bare)
    assert bare not in sys.modules


def test_no_module_is_loaded_under_a_bare_name_so_far() -> None:
    import deadweight.callbacks.stream_client
    import deadweight.sidecar.registry  # noqa: F401

    assert bare_modules_loaded() == []
