"""The sidecar's commands: serve, status, inspect, report, runs.

``deadweight demo`` is added by the top-level entry point (``deadweight.cli``): the sidecar
never imports the demo, so an install without it (the sidecar image) still has every command
here.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import __version__
from . import cli_runs, oncall_cli
from .actions import links as alert_links
from .detectors import BY_ID
from .detectors.base import Policy

if TYPE_CHECKING:
    from typing import TypeAlias

    from .checkpoints.summary_gate import GateOptions
    from .ingest.server import ServerConfig
    from .model.settings import DetectorSettings
    from .serve import SidecarConfig

    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

DEFAULT_SOCKET = "/run/deadweight/deadweight.sock"


LOG_LEVELS = ("debug", "info", "warning", "error")


def _host_port(text: str) -> str:
    """An argparse type: HOST:PORT with a port number (HOST may be empty or [v6])."""
    _, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    return text


def _cpu(text: str) -> str:
    """An argparse type: none, auto or a CPU number (``cpu_pin``)."""
    from .tuning import cpu_pin

    try:
        return cpu_pin.spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _policy(text: str) -> tuple[str, Policy]:
    detector, sep, action = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected DETECTOR=ACTION, got {text!r}")
    if detector not in BY_ID:
        raise argparse.ArgumentTypeError(
            f"unknown detector {detector!r}; known: {', '.join(sorted(BY_ID))}"
        )
    try:
        return detector, Policy(action)
    except ValueError:
        choices = "|".join(p.value for p in Policy)
        raise argparse.ArgumentTypeError(f"unknown action {action!r}; use {choices}") from None


def _url_pattern(allowed: frozenset[str]) -> Callable[[str], str]:
    """An argparse type: a URL pattern whose placeholders are all in allowed."""

    def parse(text: str) -> str:
        try:
            return alert_links.check_pattern(text, allowed)
        except alert_links.BadPattern as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _webhook_url(text: str) -> str:
    """An argparse type: an http(s) URL with a host."""
    from .actions.webhook import BadWebhookUrl, check_url

    try:
        return check_url(text)
    except BadWebhookUrl as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _serve(args: argparse.Namespace) -> int:
    import structlog

    from . import logs
    from . import serve as app
    from .actions import signal_capability
    from .ingest.server import InsecureTransport, check_transport
    from .store.files import StateDirUnsafe
    from .tuning import cpu_pin
    from .tuning import gc_settings as gc_tuning

    logs.configure(args.log_level)
    # Before any thread exists: capabilities and CPU affinity are per thread, later threads
    # inherit them.
    capability = signal_capability.raise_kill()
    try:
        cpu = cpu_pin.pin(args.cpu)
    except (ValueError, OSError) as err:
        print(f"deadweight serve: {err}", file=sys.stderr)
        return 2
    if cpu is not None:
        structlog.get_logger("deadweight.sidecar").info("cpu_pinned", cpu=cpu, asked=args.cpu)
    try:
        config = _sidecar_config(args)
        check_transport(config.server)
    except (InsecureTransport, OSError) as err:
        print(f"deadweight serve: {err}", file=sys.stderr)
        return 2
    signal_capability.announce(capability, config.trainer_uids,
                               "--trainer-uid" if args.trainer_uid else "default")
    try:
        sidecar = app.build(config)
    except (StateDirUnsafe, OSError) as err:
        print(f"deadweight serve: {err}", file=sys.stderr)
        return 2
    try:
        sidecar.start()
    except app.StartupError as err:
        print(f"deadweight serve: {err}", file=sys.stderr)
        sidecar.stop()
        sidecar.close()
        return 2

    gc_tuning.tune_garbage_collector()

    def _stop(signum: int, frame: object) -> None:
        sidecar.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    sidecar.wait()
    sidecar.close()
    return 0


def _sidecar_config(args: argparse.Namespace) -> SidecarConfig:
    """The whole sidecar's configuration from the serve flags."""
    from .serve import SidecarConfig

    return SidecarConfig(
        server=_server_config(args), state_dir=args.state_dir,
        alertmanager_url=args.alertmanager_url, webhook_urls=tuple(args.webhook_url or ()),
        runbook_url_pattern=args.runbook_url_pattern,
        dashboard_url_pattern=args.dashboard_url_pattern or (
            alert_links.dashboard_pattern_for(args.grafana_url) if args.grafana_url
            else alert_links.DEFAULT_DASHBOARD_URL_PATTERN),
        dry_run=args.dry_run, policies=dict(args.policy or []), settings=_settings(args.setting),
        max_runs=args.max_runs, max_ranks=args.max_ranks,
        max_runs_per_process=args.max_runs_per_process, max_runs_per_uid=args.max_runs_per_uid,
        run_ttl_seconds=args.run_ttl_seconds,
        stop_grace_seconds=args.stop_grace_seconds, kill_grace_seconds=args.kill_grace_seconds,
        allow_unattested=args.allow_unattested, silent_run_seconds=args.silent_run_seconds,
        trainer_uids=tuple(args.trainer_uid or default_trainer_uids()),
    )


def default_trainer_uids() -> tuple[int, ...]:
    """Without --trainer-uid: the sidecar's own uid, and root (which could stop or trace the
    sidecar anyway, so admitting it opens nothing). Another uid that merely reaches the
    socket (its group) cannot report, pre-register or squat a run id."""
    import os

    return tuple(sorted({os.geteuid(), 0}))


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """Transport settings from the serve flags (files are read here, once)."""
    from .ingest.server import ServerConfig

    token = None
    if args.token_file:
        token = Path(args.token_file).read_text().strip() or None
    return ServerConfig(
        socket_path=args.socket,
        metrics_address=args.metrics_address,
        listen=args.listen,
        token=token,
        tls_cert=Path(args.tls_cert).read_bytes() if args.tls_cert else None,
        tls_key=Path(args.tls_key).read_bytes() if args.tls_key else None,
        insecure=args.insecure,
        watch_roots=tuple(args.watch_root or ()),
        socket_group=args.socket_group,
    )


def _status(args: argparse.Namespace) -> int:
    import grpc

    from . import status

    try:
        tls_ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
        response = status.fetch(args.address, args.token, tls_ca=tls_ca)
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


def _setting(text: str) -> tuple[str, float]:
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


def _settings(pairs: list[tuple[str, float]] | None) -> DetectorSettings:
    import dataclasses

    from .model.settings import DetectorSettings

    defaults = DetectorSettings()
    values = {name: type(getattr(defaults, name))(value) for name, value in pairs or []}
    return dataclasses.replace(defaults, **values)


def _gate_options(args: argparse.Namespace) -> GateOptions:
    """The gate's trust and strictness from the inspect flags (raises BadKey, OSError)."""
    from .checkpoints.summary_gate import GateOptions

    keys = []
    if args.trust_key:
        try:
            from .store.signing_key import key_id, load_public
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
    from .checkpoints.inspector import NotACheckpoint
    from .inspect import audit, render

    try:
        gate = _gate_options(args)
        results = audit([Path(p) for p in args.paths],
                        initial=Path(args.initial) if args.initial else None,
                        settings=_settings(args.setting), gate=gate)
    except (NotACheckpoint, ValueError, OSError) as err:
        print(f"deadweight inspect: {err}", file=sys.stderr)
        return 2
    print(render(results))
    return 1 if any(r.failed for r in results) else 0


def _report(args: argparse.Namespace) -> int:
    from . import report
    from .model.settings import DetectorSettings
    from .store.files import DB_NAME
    from .store.journal import Store

    if not (Path(args.state_dir) / DB_NAME).is_file():
        print(f"deadweight report: no state database in {args.state_dir} (the sidecar's "
              "--state-dir)", file=sys.stderr)
        return 2
    store = Store(args.state_dir)
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

    serve = commands.add_parser("serve", help="run the sidecar daemon")
    serve.add_argument("--socket", default=DEFAULT_SOCKET,
                       help="unix socket to listen on (default %(default)s)")
    serve.add_argument("--metrics-address", default="127.0.0.1:9464", type=_host_port,
                       metavar="HOST:PORT", help="where /metrics and /runbooks/ are served "
                       "(default %(default)s)")
    serve.add_argument("--policy", action="append", type=_policy, metavar="DETECTOR=ACTION",
                       help="observe|page|stop|kill for one detector (repeatable)")
    serve.add_argument("--alertmanager-url", default=None, metavar="URL",
                       help="page through this Alertmanager's API v2 (e.g. http://host:9093)")
    serve.add_argument("--webhook-url", action="append", type=_webhook_url, default=None,
                       metavar="URL", help="also page this chat or incident webhook directly: "
                       "one JSON message per incident with a Slack-compatible text field "
                       "(repeatable; for teams without Alertmanager)")
    serve.add_argument("--runbook-url-pattern", type=_url_pattern(alert_links.RUNBOOK_PLACEHOLDERS),
                       default=None, metavar="PATTERN",
                       help="runbook_url of pushed alerts; {detector} and {alertname} are "
                       "filled in; use the pattern the rules were generated with (default: "
                       "this sidecar's /runbooks/ on --metrics-address, its host name for a "
                       "wildcard host)")
    links = serve.add_mutually_exclusive_group()
    links.add_argument("--dashboard-url-pattern",
                       type=_url_pattern(alert_links.DASHBOARD_PLACEHOLDERS),
                       default=None, metavar="PATTERN",
                       help="dashboard_url and generatorURL of pushed alerts and webhook "
                       "messages; {run_id} is filled in; use the pattern the rules were "
                       "generated with (default: none, pages carry no dashboard link)")
    links.add_argument("--grafana-url", default=None, metavar="URL",
                       help="the Grafana that holds the shipped dashboards: dashboard links "
                       f"become URL{alert_links.RUN_DASHBOARD_PATH}")
    serve.add_argument("--listen", default=None, metavar="HOST:PORT", type=_host_port,
                       help="also serve gRPC on TCP (needs --tls-cert, --tls-key, --token-file)")
    serve.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM certificate chain")
    serve.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key")
    serve.add_argument("--token-file", default=None, metavar="FILE",
                       help="bearer token TCP clients must present")
    serve.add_argument("--insecure", action="store_true",
                       help="allow TCP without TLS and token (never for a shared network)")
    serve.add_argument("--allow-unattested", action="store_true",
                       help="accept runs on the unix socket from processes that did not "
                       "attest (logged at start and exported as deadweight_unattested_allowed)")
    serve.add_argument("--trainer-uid", action="append", type=int, default=None,
                       metavar="UID", help="only attested processes of this uid may report "
                       "runs (repeatable; default: the sidecar's own uid and root, so another "
                       "uid that can reach the socket cannot report)")
    serve.add_argument("--socket-group", type=int, default=None, metavar="GID",
                       help="hand the unix sockets (mode 0660) to this group, one the sidecar "
                       "and the trainer share, when they run as different uids (default: the "
                       "sidecar's group, or the folder's when it is setgid)")
    serve.add_argument("--silent-run-seconds", type=float, default=3600.0, metavar="SECONDS",
                       help="end a live run that sent nothing for this long (default 3600)")
    serve.add_argument("--watch-root", action="append", default=None, metavar="DIR",
                       help="folder under which runs' checkpoints may be read (repeatable); "
                       "without one, no client-named path is read and every run's output "
                       "folder is refused with a finding")
    serve.add_argument("--state-dir", default=None, metavar="DIR",
                       help="keep runs, checkpoint hashes, incidents and the action journal "
                       "here (SQLite) so a restart resumes them; default: memory only")
    serve.add_argument("--stop-grace-seconds", type=float, default=120.0, metavar="SECONDS",
                       help="kill policy: SIGTERM this long after STOP if the run still steps "
                       "(default %(default)s)")
    serve.add_argument("--kill-grace-seconds", type=float, default=30.0, metavar="SECONDS",
                       help="kill policy: SIGKILL this long after SIGTERM if still alive "
                       "(default %(default)s)")
    serve.add_argument("--dry-run", action="store_true",
                       help="log what each action would do, do nothing")
    serve.add_argument("--run-ttl-seconds", type=float, default=900.0, metavar="SECONDS",
                       help="forget an ended run (and its series) after this long "
                       "(default %(default)s)")
    serve.add_argument("--max-runs", type=int, default=1000,
                       help="most runs tracked at once; the oldest ended run makes room "
                       "(default %(default)s)")
    serve.add_argument("--max-runs-per-process", type=int, default=64,
                       help="most live runs one process may hold; when the table is full, "
                       "the process holding the most live runs gives one up to a newcomer "
                       "of another process (default %(default)s)")
    serve.add_argument("--max-runs-per-uid", type=int, default=256,
                       help="most live runs the processes of one uid may hold together "
                       "(default %(default)s)")
    serve.add_argument("--max-ranks", type=int, default=4096,
                       help="most ranks held across all runs (each keeps a window of steps); "
                       "a rank beyond it is refused, after ended runs make room "
                       "(default %(default)s)")
    serve.add_argument("--setting", action="append", type=_setting, metavar="NAME=VALUE",
                       help="override a detector threshold or window, e.g. stalled_seconds=600 "
                       "(repeatable; names and defaults in the README)")
    serve.add_argument("--cpu", default="none", type=_cpu, metavar="none|auto|N",
                       help="run every sidecar thread on one CPU: N, or auto (the one it "
                            "starts on); its Python uses one CPU at a time anyway, and "
                            "pinned it spends about a third less CPU per record (default none)")
    serve.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                       help="(default %(default)s)")
    serve.set_defaults(func=_serve)

    status_cmd = commands.add_parser("status", help="live runs and verdicts of a sidecar")
    status_cmd.add_argument("--address", default=f"unix://{DEFAULT_SOCKET}",
                            help="sidecar address (default %(default)s)")
    status_cmd.add_argument("--token", default=None,
                            help="bearer token (a TCP sidecar requires one)")
    status_cmd.add_argument("--tls-ca", default=None, metavar="FILE",
                            help="PEM CA that signed a TCP sidecar's certificate")
    status_cmd.add_argument("--json", action="store_true",
                            help="one JSON document with stable keys (schema "
                            "deadweight.status/v1, listed in the README)")
    status_cmd.set_defaults(func=_status)
    cli_runs.add_runs(commands, f"unix://{DEFAULT_SOCKET}")

    inspect = commands.add_parser(
        "inspect", help="audit checkpoint folders or adapter files offline (exit 1 on findings)")
    inspect.add_argument("paths", nargs="+", metavar="PATH",
                         help="checkpoint folders or .safetensors files, oldest first")
    inspect.add_argument("--initial", default=None, metavar="PATH",
                         help="the adapter the run started from: flag checkpoints equal to it")
    inspect.add_argument("--setting", action="append", type=_setting, metavar="NAME=VALUE",
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
                            type=_url_pattern(alert_links.RUNBOOK_PLACEHOLDERS),
                            default=alert_links.DEFAULT_RUNBOOK_URL_PATTERN, metavar="PATTERN",
                            help="the runbook link under the root cause, as in serve "
                            "(default %(default)s)")
    report_cmd.set_defaults(func=_report)
    oncall_cli.add(commands)
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
