"""Argument types the sidecar's commands share (a detector threshold, a link pattern, the
bearer token of a TCP sidecar)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
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


#: Where the commands (and the training callback) read the TCP bearer token from.
TOKEN_ENV = "DEADWEIGHT_TOKEN"


def add_token_args(parser: argparse.ArgumentParser) -> None:
    """--token-file and --token (a TCP sidecar requires a bearer token)."""
    parser.add_argument("--token-file", default=None, metavar="FILE",
                        help=f"read the bearer token a TCP sidecar requires from FILE (or set "
                        f"{TOKEN_ENV}); it never shows in the process list")
    parser.add_argument("--token", default=None,
                        help="the bearer token itself: every user of this machine can read it "
                        "in the process list; prefer --token-file or " + TOKEN_ENV)


def token_from(args: argparse.Namespace, command: str) -> str | None:
    """The bearer token: --token-file, else $DEADWEIGHT_TOKEN, else --token (with a warning
    on stderr: argv is readable by every uid). Raises OSError for an unreadable file."""
    if args.token_file:
        return Path(args.token_file).read_text().strip() or None
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip() or None
    if args.token:
        print(f"deadweight {command}: warning: --token shows in the process list to every "
              f"user of this machine; use --token-file or {TOKEN_ENV}", file=sys.stderr)
        return str(args.token)
    return None
