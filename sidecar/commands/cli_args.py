"""Argument types the sidecar's commands share (a detector threshold, a link pattern), and
the read-only commands' way into a state dir's journal."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..actions import links as alert_links

if TYPE_CHECKING:
    from ..model.settings import DetectorSettings
    from ..store.journal import Store


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to a mistyped one, else ""."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def url_pattern(allowed: frozenset[str]) -> Callable[[str], str]:
    """An argparse type: a URL pattern whose placeholders are all in allowed."""

    def parse(text: str) -> str:
        try:
            return alert_links.check_pattern(text, allowed)
        except alert_links.BadPattern as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def setting(text: str) -> tuple[str, float]:
    """NAME=VALUE for one DetectorSettings field (thresholds, windows, seconds)."""
    import dataclasses

    from ..model.settings import DetectorSettings

    name, sep, value = text.partition("=")
    fields = {f.name: f for f in dataclasses.fields(DetectorSettings)}
    if not sep or name not in fields:
        unknown = f"unknown setting {name!r}{did_you_mean(name, fields)}; " if sep else ""
        raise argparse.ArgumentTypeError(
            f"{unknown}expected NAME=VALUE with NAME one of: {', '.join(sorted(fields))}")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a number") from None


def settings(pairs: list[tuple[str, float]] | None) -> DetectorSettings:
    import dataclasses

    from ..model.settings import DetectorSettings

    defaults = DetectorSettings()
    values = {name: type(getattr(defaults, name))(value) for name, value in pairs or []}
    return dataclasses.replace(defaults, **values)


def state_store(command: str, state_dir: str) -> Store | None:
    """The journal in a sidecar's state dir (or a folder holding a copy of its database),
    for a command that only reads it; None after saying on stderr why not (exit 2)."""
    import sys
    from pathlib import Path

    from ..store.files import DB_NAME, StateDirUnsafe
    from ..store.journal import Store

    if not (Path(state_dir) / DB_NAME).is_file():
        print(f"deadweight {command}: no state database in {state_dir} (the sidecar's "
              f"--state-dir, or a folder holding a copy of its {DB_NAME})", file=sys.stderr)
        return None
    try:
        return Store(state_dir)
    except (StateDirUnsafe, OSError) as err:
        print(f"deadweight {command}: {err}", file=sys.stderr)
        return None
