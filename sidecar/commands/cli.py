"""The sidecar's commands: serve, status, inspect, report, runs.

``deadweight demo`` is added by the top-level entry point (``deadweight.cli``): the sidecar
never imports the demo, so an install without it (the sidecar image) still has every command
here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ... import __version__
from ..actions import links as alert_links
from . import baseline_cli, cli_runs, cli_token, oncall_cli, serve_cli
from .cli_args import setting, settings, state_store, url_pattern

if TYPE_CHECKING:
    from typing import TypeAlias

    from ..checkpoints.summary_gate import GateOptions

    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

DEFAULT_SOCKET = "/run/deadweight/deadweight.sock"


def _status(args: argparse.Namespace) -> int:
    import grpc

    from . import status

    try:
        tls_ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
        token = cli_token.token_from(args, "status")
    except OSError as err:
        print(f"deadweight status: {err}", file=sys.stderr)
        return 2
    try:
        response = status.fetch(args.address, token, tls_ca=tls_ca)
    except grpc.RpcError as err:
        print(f"deadweight: cannot reach the sidecar at {args.address}: {err.code().name}",
              file=sys.stderr)
        return 2
    if args.json:
        from . import status_json

        print(status_json.dumps(response))
    else:
        print(status.render(response))
    return 0


def _gate_options(args: argparse.Namespace) -> GateOptions:
    """The gate's trust and strictness from the inspect flags (raises BadKey, OSError)."""
    from ..checkpoints.summary_gate import GateOptions

    keys = []
    if args.trust_key:
        try:
            from ..store.signing_key import key_id, load_public
        except ImportError as err:
            raise ValueError(f"--trust-key needs the cryptography package ({err})") from err
        keys = [load_public(Path(p)) for p in args.trust_key]
    if args.require_signed and not keys:
        raise ValueError("--require-signed needs --trust-key FILE (the sidecar's "
                         "summary-signing.pub)")
    return GateOptions(trusted={key_id(k): k for k in keys} if keys else {},
                       require_signed=args.require_signed,
                       require_summary=args.require_summary, fail_on=args.fail_on)


def _inspect(args: argparse.Namespace) -> int:
    from ..checkpoints.inspector import NotACheckpoint
    from .inspect import audit, exit_status, render

    try:
        gate = _gate_options(args)
        results = audit([Path(p) for p in args.paths],
                        initial=Path(args.initial) if args.initial else None,
                        settings=settings(args.setting), gate=gate)
    except (NotACheckpoint, ValueError, OSError) as err:
        print(f"deadweight inspect: {err}", file=sys.stderr)
        return 2
    print(render(results))
    return exit_status(results)


def _report(args: argparse.Namespace) -> int:
    from ..model.settings import DetectorSettings
    from . import report

    store = state_store("report", args.state_dir)
    if store is None:
        return 2
    try:
        page = report.render(report.load(store, args.run_id, args.incarnation),
                             frozen_ratio_floor=DetectorSettings().frozen_ratio_floor,
                             runbook_url_pattern=args.runbook_url_pattern)
    except report.ReportUnavailable as err:
        print(f"deadweight report: {err}", file=sys.stderr)
        return 2
    finally:
        store.close()
    out = Path(args.out or f"deadweight-{args.run_id}.html")
    out.write_text(page, encoding="utf-8")
    print(f"deadweight report: wrote {out}")
    return 0


def build_parser(*more_commands: Callable[[Commands], None]) -> argparse.ArgumentParser:
    """The sidecar's commands; each of ``more_commands`` adds its own to the same parser."""
    parser = argparse.ArgumentParser(
        prog="deadweight",
        description="Catch fine-tuning runs that report a healthy loss while their weights "
        "stay frozen.",
    )
    parser.add_argument("--version", action="version", version=f"deadweight {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cli.add_serve(commands, DEFAULT_SOCKET)

    status_cmd = commands.add_parser("status", help="live runs and verdicts of a sidecar")
    status_cmd.add_argument("--address", default=f"unix://{DEFAULT_SOCKET}",
                            help="sidecar address (default %(default)s)")
    cli_token.add_token_args(status_cmd)
    status_cmd.add_argument("--tls-ca", default=None, metavar="FILE",
                            help="PEM CA that signed a TCP sidecar's certificate")
    status_cmd.add_argument("--json", action="store_true",
                            help="one JSON document with stable keys (schema "
                            "deadweight.status/v1, listed in the README)")
    status_cmd.set_defaults(func=_status)
    cli_runs.add_runs(commands, f"unix://{DEFAULT_SOCKET}")

    inspect = commands.add_parser(
        "inspect", help="audit checkpoint folders or adapter files offline (exit 1 on findings)",
        description="Audit checkpoint folders or adapter files offline: a promotion gate.",
        epilog="exit status: 0 every adapter passes; 1 one fails the gate; 2 a path is not a "
        "checkpoint, or a flag is wrong; 3 none fails, but a run summary holds no verdicts "
        "(written without a sidecar: the run was never judged; UNJUDGED in the listing). "
        "A gate that accepts only judged runs treats 3 as a failure.")
    inspect.add_argument("paths", nargs="+", metavar="PATH",
                         help="checkpoint folders or .safetensors files, oldest first; a "
                         "run's output folder stands for its checkpoint-<step> folders and "
                         "the adapter folders under it (final/)")
    inspect.add_argument("--initial", default=None, metavar="PATH",
                         help="the adapter the run started from: flag checkpoints equal to it")
    inspect.add_argument("--setting", action="append", type=setting, metavar="NAME=VALUE",
                         help="override a detector threshold (e.g. adapter_bloat_ratio=2)")
    inspect.add_argument("--trust-key", action="append", default=None, metavar="FILE",
                         help="a sidecar's public key (summary-signing.pub in its state dir, "
                         "named in its start log): verify the run summaries' signatures "
                         "(repeatable)")
    inspect.add_argument("--require-signed", action="store_true",
                         help="fail an adapter whose summary is unsigned or signed by an "
                         "untrusted key (needs --trust-key)")
    inspect.add_argument("--require-summary", action="store_true",
                         help="fail an adapter with no run summary beside it or up the folders")
    inspect.add_argument("--fail-on", choices=("critical", "warning"), default="critical",
                         help="the least severe run verdict that fails the gate (default "
                         "%(default)s; findings on the adapter's own files always fail)")
    inspect.set_defaults(func=_inspect)

    report_cmd = commands.add_parser(
        "report", help="one self-contained HTML page per run, from the sidecar's state dir")
    report_cmd.add_argument("run_id", metavar="RUN_ID")
    report_cmd.add_argument("--state-dir", required=True, metavar="DIR",
                            help="the --state-dir of the sidecar that watched the run")
    report_cmd.add_argument("--incarnation", type=int, default=None, metavar="N",
                            help="which life of a run id used again (default: the newest; "
                            "deadweight runs lists them)")
    report_cmd.add_argument("--out", default=None, metavar="FILE.html",
                            help="where to write it (default deadweight-RUN_ID.html)")
    report_cmd.add_argument("--runbook-url-pattern",
                            type=url_pattern(alert_links.RUNBOOK_PLACEHOLDERS),
                            default=alert_links.DEFAULT_RUNBOOK_URL_PATTERN, metavar="PATTERN",
                            help="the runbook link under the root cause, as in serve "
                            "(default %(default)s)")
    report_cmd.set_defaults(func=_report)
    oncall_cli.add(commands)
    baseline_cli.add(commands)
    for add in more_commands:
        add(commands)
    return parser


#: The exit status of a command whose reader closed the pipe (``deadweight status | head``):
#: 128 + SIGPIPE, as the shell reports a command the pipe ended.
EXIT_PIPE_CLOSED = 141


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; a reader that stops early (``| head``) ends it quietly."""
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's own flush at exit fails no more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
