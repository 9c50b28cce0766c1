"""``deadweight serve``: the sidecar daemon's flags, the configuration they make, and its
start (the composition itself is ``serve.build``)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..actions import links as alert_links
from ..detectors import BY_ID
from ..detectors.base import Policy
from .cli_args import did_you_mean, setting, settings, url_pattern

if TYPE_CHECKING:
    from ..ingest.server import ServerConfig
    from ..serve import Sidecar, SidecarConfig
    from .cli import Commands

LOG_LEVELS = ("debug", "info", "warning", "error")


def host_port(text: str) -> str:
    """An argparse type: HOST:PORT with a port number (HOST may be empty or [v6])."""
    _, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    return text


def cpu(text: str) -> str:
    """An argparse type: none, auto or a CPU number (``cpu_pin``)."""
    from ..tuning import cpu_pin

    try:
        return cpu_pin.spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def policy_arg(text: str) -> tuple[str, Policy]:
    detector, sep, action = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected DETECTOR=ACTION, got {text!r}")
    if detector not in BY_ID:
        raise argparse.ArgumentTypeError(
            f"unknown detector {detector!r}{did_you_mean(detector, BY_ID)}; known: "
            f"{', '.join(sorted(BY_ID))}"
        )
    try:
        return detector, Policy(action)
    except ValueError:
        choices = "|".join(p.value for p in Policy)
        raise argparse.ArgumentTypeError(f"unknown action {action!r}; use {choices}") from None


def state_dir_arg(text: str) -> str:
    """An argparse type: a folder for the state database, existing or creatable (no part of
    the path is a file), so a mistyped path fails with the flag's name, not a bare errno."""
    path = Path(text)
    for part in (path, *path.parents):
        if not part.exists():
            continue
        if not part.is_dir():
            what = "it is" if part == path else f"{part} is"
            raise argparse.ArgumentTypeError(
                f"{text} cannot be the state folder: {what} a file, not a folder (give a "
                "folder; it is created if missing)")
        break
    return text


def webhook_url_arg(text: str) -> str:
    """An argparse type: an http(s) URL with a host."""
    from ..actions.webhook import BadWebhookUrl, check_url

    try:
        return check_url(text)
    except BadWebhookUrl as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def webhook_urls_from(files: list[str] | None) -> tuple[str, ...]:
    """The webhook URLs kept in files (one a line; blank lines and # comments skipped), so
    no secret in a URL shows in the process list. Raises OSError or ValueError."""
    from ..actions.webhook import check_url

    urls = []
    for name in files or ():
        for line in Path(name).read_text().splitlines():
            text = line.strip()
            if text and not text.startswith("#"):
                urls.append(check_url(text))
    return tuple(urls)


def alertmanager_url_from(given: str | None, file: str | None) -> str | None:
    """The Alertmanager URL, from --alertmanager-url or the file --alertmanager-url-file
    names (its first line that is not blank or a # comment), so a ``user:password@`` it
    carries stays out of the process list. Raises OSError or ValueError."""
    from ..actions.webhook import check_url

    if file is None:
        return given
    if given is not None:
        raise ValueError("give --alertmanager-url or --alertmanager-url-file, not both")
    for line in Path(file).read_text().splitlines():
        text = line.strip()
        if text and not text.startswith("#"):
            return check_url(text)
    raise ValueError(f"{file} holds no Alertmanager URL (one line: http(s)://host:port)")


def _credentials_in(url: str | None) -> bool:
    from urllib.parse import urlsplit

    return url is not None and urlsplit(url).password is not None


def _serve(args: argparse.Namespace) -> int:
    import structlog

    from .. import logs
    from .. import serve as app
    from ..actions import signal_capability
    from ..ingest.server import InsecureTransport, check_transport
    from ..store.files import StateDirUnsafe
    from ..tuning import cpu_pin
    from ..tuning import gc_settings as gc_tuning

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
    if args.webhook_url:
        structlog.get_logger("deadweight.sidecar").warning(
            "webhook_url_in_argv", urls=len(args.webhook_url),
            note="every user of this machine can read --webhook-url in the process list, "
            "with the secret its path or user:password@ carries; use --webhook-url-file")
    if _credentials_in(args.alertmanager_url):
        structlog.get_logger("deadweight.sidecar").warning(
            "alertmanager_url_in_argv",
            note="every user of this machine can read --alertmanager-url in the process "
            "list, with the user:password@ it carries; use --alertmanager-url-file")
    try:
        config = sidecar_config(args)
        check_transport(config.server)
    except (InsecureTransport, OSError, ValueError) as err:
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
        log_stopping(sidecar, signal.Signals(signum).name)
        sidecar.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    sidecar.wait()
    sidecar.close()
    return 0


def log_stopping(sidecar: Sidecar, why: str) -> None:
    """One line saying the sidecar stops, why, what it leaves live and where its state is:
    the runs still live lose their monitoring until a sidecar on the same state resumes them."""
    import structlog

    live = sum(1 for run, _ in sidecar.registry.runs() if not run.ended)
    logger = structlog.get_logger("deadweight.sidecar")
    (logger.warning if live else logger.info)(
        "sidecar_stopping", reason=f"{why} received", live_runs=live,
        state_dir=sidecar.state_dir or "none (memory only: the runs are not kept)")


def sidecar_config(args: argparse.Namespace) -> SidecarConfig:
    """The whole sidecar's configuration from the serve flags."""
    from ..serve import SidecarConfig

    return SidecarConfig(
        server=_server_config(args), state_dir=args.state_dir,
        alertmanager_url=alertmanager_url_from(args.alertmanager_url, args.alertmanager_url_file),
        webhook_urls=tuple(args.webhook_url or ()) + webhook_urls_from(args.webhook_url_file),
        pager_deadline=args.pager_deadline, pager_backoff=args.pager_backoff,
        pager_backoff_max=args.pager_backoff_max,
        pager_resend_interval=args.pager_resend_interval,
        runbook_url_pattern=args.runbook_url_pattern,
        dashboard_url_pattern=args.dashboard_url_pattern or (
            alert_links.dashboard_pattern_for(args.grafana_url) if args.grafana_url
            else alert_links.DEFAULT_DASHBOARD_URL_PATTERN),
        dry_run=args.dry_run, policies=dict(args.policy or []), settings=settings(args.setting),
        max_runs=args.max_runs, max_ranks=args.max_ranks,
        max_runs_per_process=args.max_runs_per_process, max_runs_per_uid=args.max_runs_per_uid,
        reclaim_unstepped_seconds=args.reclaim_unstepped_seconds,
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
    from ..ingest.server import ServerConfig

    token = None
    if args.token_file:
        token = Path(args.token_file).read_text().strip() or None
    return ServerConfig(
        socket_path=args.socket,
        operator_uids=tuple(args.operator_uid or ()),
        metrics_address=args.metrics_address,
        listen=args.listen,
        token=token,
        tls_cert=Path(args.tls_cert).read_bytes() if args.tls_cert else None,
        tls_key=Path(args.tls_key).read_bytes() if args.tls_key else None,
        insecure=args.insecure,
        auth_failure_burst=args.auth_failure_burst,
        auth_failure_refill_seconds=args.auth_failure_refill,
        watch_roots=tuple(args.watch_root or ()),
        socket_group=args.socket_group,
    )


def add_serve(commands: Commands, default_socket: str) -> None:
    """The ``serve`` command and its flags."""
    serve = commands.add_parser("serve", help="run the sidecar daemon")
    serve.add_argument("--socket", default=default_socket,
                       help="unix socket to listen on (default %(default)s)")
    serve.add_argument("--metrics-address", default="127.0.0.1:9464", type=host_port,
                       metavar="HOST:PORT", help="where /metrics and /runbooks/ are served "
                       "(default %(default)s)")
    serve.add_argument("--policy", action="append", type=policy_arg, metavar="DETECTOR=ACTION",
                       help="observe|page|stop|kill for one detector (repeatable)")
    serve.add_argument("--alertmanager-url", default=None, metavar="URL",
                       help="page through this Alertmanager's API v2 (e.g. http://host:9093; "
                       "user:password@ is sent as Basic auth but shows in the process list: "
                       "prefer --alertmanager-url-file)")
    serve.add_argument("--alertmanager-url-file", default=None, metavar="FILE",
                       help="page through the Alertmanager whose URL this file holds (its "
                       "first line; keeps the URL's user:password@ out of the process list)")
    serve.add_argument("--webhook-url", action="append", type=webhook_url_arg, default=None,
                       metavar="URL", help="also page this chat or incident webhook directly: "
                       "one JSON message per incident with a Slack-compatible text field "
                       "(repeatable; for teams without Alertmanager). The URL shows in "
                       "the process list: prefer --webhook-url-file")
    serve.add_argument("--webhook-url-file", action="append", default=None, metavar="FILE",
                       help="page the webhook URLs this file holds, one a line (repeatable; "
                       "keeps a URL's secret path or user:password@ out of the process list)")
    serve.add_argument("--pager-deadline", type=float, default=10.0, metavar="SECONDS",
                       help="one delivery attempt to a pager target, connect to last byte "
                       "of the answer (default %(default)s)")
    serve.add_argument("--pager-backoff", type=float, default=0.5, metavar="SECONDS",
                       help="first wait before a failed delivery is tried again; it doubles "
                       "up to --pager-backoff-max, until the target acknowledges "
                       "(default %(default)s)")
    serve.add_argument("--pager-backoff-max", type=float, default=30.0, metavar="SECONDS",
                       help="(default %(default)s)")
    serve.add_argument("--pager-resend-interval", type=float, default=60.0, metavar="SECONDS",
                       help="how often firing alerts are re-asserted to Alertmanager (their "
                       "endsAt is 4 times this ahead; default %(default)s)")
    serve.add_argument("--runbook-url-pattern", type=url_pattern(alert_links.RUNBOOK_PLACEHOLDERS),
                       default=None, metavar="PATTERN",
                       help="runbook_url of pushed alerts; {detector} and {alertname} are "
                       "filled in; use the pattern the rules were generated with (default: "
                       "this sidecar's /runbooks/ on --metrics-address, its host name for a "
                       "wildcard host)")
    links = serve.add_mutually_exclusive_group()
    links.add_argument("--dashboard-url-pattern",
                       type=url_pattern(alert_links.DASHBOARD_PLACEHOLDERS),
                       default=None, metavar="PATTERN",
                       help="dashboard_url and generatorURL of pushed alerts and webhook "
                       "messages; {run_id} is filled in; use the pattern the rules were "
                       "generated with (default: none, pages carry no dashboard link)")
    links.add_argument("--grafana-url", default=None, metavar="URL",
                       help="the Grafana that holds the shipped dashboards: dashboard links "
                       f"become URL{alert_links.RUN_DASHBOARD_PATH}")
    serve.add_argument("--listen", default=None, metavar="HOST:PORT", type=host_port,
                       help="also serve gRPC on TCP (needs --tls-cert, --tls-key, --token-file)")
    serve.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM certificate chain")
    serve.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key")
    serve.add_argument("--token-file", default=None, metavar="FILE",
                       help="bearer token TCP clients must present")
    serve.add_argument("--auth-failure-burst", type=int, default=20, metavar="N",
                       help="failed TCP tokens a host may present before its calls are "
                       "refused unread (default %(default)s)")
    serve.add_argument("--auth-failure-refill", type=float, default=1.0, metavar="SECONDS",
                       help="a throttled host may try once more after this long "
                       "(default %(default)s)")
    serve.add_argument("--insecure", action="store_true",
                       help="allow TCP without TLS and token (never for a shared network)")
    serve.add_argument("--allow-unattested", action="store_true",
                       help="accept runs on the unix socket from processes that did not "
                       "attest (logged at start and exported as deadweight_unattested_allowed)")
    serve.add_argument("--trainer-uid", action="append", type=int, default=None,
                       metavar="UID", help="only attested processes of this uid may report "
                       "runs (repeatable; default: the sidecar's own uid and root, so another "
                       "uid that can reach the socket cannot report)")
    serve.add_argument("--operator-uid", action="append", type=int, default=None,
                       metavar="UID", help="a uid that may `deadweight stop` and `silence` "
                       "runs besides root (repeatable). The sidecar's own uid may too, unless "
                       "it is a trainer uid: on-call powers never come with being a trainer")
    serve.add_argument("--socket-group", type=int, default=None, metavar="GID",
                       help="hand the unix sockets (mode 0660) to this group, one the sidecar "
                       "and the trainer share, when they run as different uids (default: the "
                       "sidecar's group, or the folder's when it is setgid)")
    serve.add_argument("--silent-run-seconds", type=float, default=3600.0, metavar="SECONDS",
                       help="end a live run that sent nothing for this long (default 3600)")
    serve.add_argument("--watch-root", action="append", default=None, metavar="DIR",
                       help="read checkpoints only under DIR (repeatable; a run that did "
                       "not attest is read only there); without it, a checkpoint is read when "
                       "its folder and files belong to the run's attested uid")
    serve.add_argument("--state-dir", default=None, metavar="DIR", type=state_dir_arg,
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
    serve.add_argument("--reclaim-unstepped-seconds", type=float, default=600.0,
                       metavar="SECONDS",
                       help="a live run that reported no optimizer step this long after it "
                       "registered gives up its slot before a newcomer is refused for a full "
                       "--max-runs or --max-runs-per-uid (default %(default)s)")
    serve.add_argument("--max-ranks", type=int, default=4096,
                       help="most ranks held across all runs (each keeps a window of steps); "
                       "a rank beyond it is refused, after ended runs make room "
                       "(default %(default)s)")
    serve.add_argument("--setting", action="append", type=setting, metavar="NAME=VALUE",
                       help="override a detector threshold or window, e.g. stalled_seconds=600 "
                       "(repeatable; names and defaults in the README)")
    serve.add_argument("--cpu", default="none", type=cpu, metavar="none|auto|N",
                       help="run every sidecar thread on one CPU: N, or auto (the one it "
                            "starts on); its Python uses one CPU at a time anyway, and "
                            "pinned it spends about a third less CPU per record (default none)")
    serve.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                       help="(default %(default)s)")
    serve.set_defaults(func=_serve)
