"""The two sides stay apart, the rooms are layered, and every module has one import name.

``lint-imports`` (contracts in pyproject.toml) checks the static imports; ruff refuses a bare
folder name (``import sidecar``) anywhere; the runtime check below loads the sidecar the way
its image does, without the training side, the demo or torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The repository's folders that ``deadweight/`` links under ``deadweight.*``.
BARE_NAMES = ("callbacks", "demo", "proto", "sidecar")

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


@pytest.mark.parametrize("bare", BARE_NAMES)
def test_a_bare_folder_name_is_refused_by_the_linter(bare: str) -> None:
    """ruff (TID251, configured in pyproject.toml) fails any file importing a bare name."""
    ruff = Path(sys.executable).parent / "ruff"
    source = f"import {bare}.x\nfrom {bare} import y\n\nprint({bare}, y)\n"
    result = subprocess.run([str(ruff), "check", "--no-cache", "--stdin-filename",
                             "tests/test_bare.py", "-"], input=source, capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.count("TID251") == 2, result.stdout
    assert f"deadweight.{bare}" in result.stdout
