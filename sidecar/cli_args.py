"""Argument types the sidecar's commands share (a detector threshold, a link pattern)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from .actions import links as alert_links

if TYPE_CHECKING:
    from .model.settings import DetectorSettings


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

    from .model.settings import DetectorSettings

    name, sep, value = text.partition("=")
    fields = {f.name: f for f in dataclasses.fields(DetectorSettings)}
    if not sep or name not in fields:
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE with NAME one of: {', '.join(sorted(fields))}")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a number") from None


def settings(pairs: list[tuple[str, float]] | None) -> DetectorSettings:
    import dataclasses

    from .model.settings import DetectorSettings

    defaults = DetectorSettings()
    values = {name: type(getattr(defaults, name))(value) for name, value in pairs or []}
    return dataclasses.replace(defaults, **values)
