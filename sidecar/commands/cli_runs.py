"""``deadweight runs``: on-call's listing of runs, from a state dir or a live sidecar.

Its own module (the parser and the handler) so the other on-call commands grow beside it
without touching each other; ``cli.build_parser`` adds it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .cli_args import state_store
from .cli_token import add_token_args, token_from

if TYPE_CHECKING:
    from .cli import Commands


def _runs(args: argparse.Namespace) -> int:
    from . import runs_listing

    if args.state_dir is not None:
        store = state_store("runs", args.state_dir)
        if store is None:
            return 2
        try:
            lines, source = runs_listing.from_store(store), "state_dir"
        finally:
            store.close()
    else:
        import grpc

        from . import status

        try:
            tls_ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
            token = token_from(args, "runs")
        except OSError as err:
            print(f"deadweight runs: {err}", file=sys.stderr)
            return 2
        try:
            response = status.fetch(args.address, token, tls_ca=tls_ca)
        except grpc.RpcError as err:
            print(f"deadweight runs: cannot reach the sidecar at {args.address}: "
                  f"{err.code().name} (or list a state dir: --state-dir DIR)", file=sys.stderr)
            return 2
        lines, source = runs_listing.from_status(response), "sidecar"
    print(runs_listing.dumps(lines, source) if args.json else runs_listing.render(lines))
    return 0


def add_runs(commands: Commands, default_address: str) -> None:
    runs = commands.add_parser(
        "runs", help="list runs (id, trainer, start, end, final verdicts) of a state dir or a "
        "live sidecar")
    runs.add_argument("--state-dir", default=None, metavar="DIR",
                      help="read this state dir (the sidecar's, or a copy of its database; no "
                      "sidecar needs to run) instead of asking a live sidecar")
    runs.add_argument("--address", default=default_address,
                      help="live sidecar address (default %(default)s)")
    add_token_args(runs)
    runs.add_argument("--tls-ca", default=None, metavar="FILE",
                      help="PEM CA that signed a TCP sidecar's certificate")
    runs.add_argument("--json", action="store_true",
                      help="one JSON document with stable keys (schema deadweight.runs/v1)")
    runs.set_defaults(func=_runs)
