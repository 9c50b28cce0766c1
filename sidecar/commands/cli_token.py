"""The bearer token on-call's commands present to a TCP sidecar, kept out of argv.

Every uid on a machine reads every process's argv (``/proc/<pid>/cmdline``), so
``deadweight status`` and ``deadweight runs`` read the token from ``--token-file`` or
``DEADWEIGHT_TOKEN`` (the training callback's variable too); ``--token`` still works and
warns.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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
