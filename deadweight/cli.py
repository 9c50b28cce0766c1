"""The ``deadweight`` command: the sidecar's commands plus ``deadweight demo``.

The sidecar (``deadweight.sidecar.commands.cli``) never imports the demo; this entry point adds the
``demo`` command and imports the demo only when it runs. An install without the demo or without
the training extra (the sidecar image) keeps every other command and says what the demo needs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .sidecar.commands import cli as sidecar_cli

if TYPE_CHECKING:
    from .sidecar.commands.cli import Commands

#: What the demo trains with: the ``train`` extra.
TRAINING_MODULES = ("torch", "transformers", "trl", "peft")


def _missing_for_demo() -> str | None:
    """Why the demo cannot run in this install, None when it can."""
    try:
        importlib.import_module("deadweight.demo.scenario")
    except ModuleNotFoundError as err:
        if err.name not in ("deadweight.demo", "deadweight.demo.scenario"):
            raise
        return ("this install holds no demo (the sidecar image ships the sidecar only); "
                "run it where the package is installed with: pip install 'deadweight[train]'")
    for name in TRAINING_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            return (f"the demo trains a tiny model and needs {name!r}; "
                    "install the training extra: pip install 'deadweight[train]'")
    return None


def _demo(args: argparse.Namespace) -> int:
    why = _missing_for_demo()
    if why is not None:
        print(f"deadweight demo: {why}", file=sys.stderr)
        return 2
    from .demo import scenario

    return scenario.main(workdir=Path(args.workdir) if args.workdir else None,
                         steps=args.steps)


def add_demo(commands: Commands) -> None:
    """The ``demo`` command; its arguments are known without importing the demo."""
    demo = commands.add_parser("demo", help="catch a real frozen-adapter run on a tiny model")
    demo.add_argument("--workdir", default=None, help="keep the demo's files here")
    demo.add_argument("--steps", type=int, default=12, help="steps per run")
    demo.set_defaults(func=_demo)


def build_parser() -> argparse.ArgumentParser:
    return sidecar_cli.build_parser(add_demo)


def main(argv: Sequence[str] | None = None) -> int:
    return sidecar_cli.run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
