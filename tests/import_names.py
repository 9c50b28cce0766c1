"""One import name per module under pytest: ``deadweight.sidecar.x``, never ``sidecar.x``.

The repo root stays on ``sys.path`` (the ``tests`` package and an uninstalled checkout need it),
so its folders ``sidecar/``, ``callbacks/``, ``proto/`` and ``demo/`` would import as top-level
packages too, and a module loaded under both names runs twice with two copies of its state.
The conftest installs ``BareNameGuard`` before any test module is imported, so such an import
fails at once with the right name; ``pytest_sessionfinish`` fails the run if one slipped in
anyway (loaded before the guard, e.g. by a plugin).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The repo root's folders that ``deadweight/`` links under ``deadweight.*``.
BARE_NAMES = frozenset({"sidecar", "callbacks", "proto", "demo"})


def _is_ours(name: str) -> bool:
    """Whether ``name`` would load one of the repo root's linked folders."""
    spec = importlib.machinery.PathFinder.find_spec(name)
    return spec is not None and any(
        Path(location).resolve().is_relative_to(ROOT)
        for location in (spec.submodule_search_locations or [spec.origin or ""]) if location
    )


class BareNameGuard(importlib.abc.MetaPathFinder):
    """Refuses ``import sidecar`` (and the other bare names) when it means the repo's folder."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in BARE_NAMES and _is_ours(fullname):
            raise ImportError(
                f"import {fullname!r} as 'deadweight.{fullname}': the bare name would load "
                "every module a second time under another name", name=fullname)
        return None


def install() -> None:
    """Put the guard first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, BareNameGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, BareNameGuard())


def bare_modules_loaded() -> list[str]:
    """Modules loaded from the repo root's folders under their bare names."""
    return sorted(name for name in sys.modules if name.split(".")[0] in BARE_NAMES
                  and _loaded_from_root(sys.modules[name]))


def _loaded_from_root(module: ModuleType | None) -> bool:
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    return bool(origin) and Path(str(origin)).resolve().is_relative_to(ROOT)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    loaded = bare_modules_loaded()
    if loaded:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"modules loaded under a second, bare name (use deadweight.*): {loaded}"
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(message, red=True)
        else:
            print(message, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
