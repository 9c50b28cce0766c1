"""The sidecar daemon: turns the training side's stream into verdicts, metrics, pages and stops.

Its rooms, top to bottom (a room imports only rooms below it; ``lint-imports`` checks it):

- ``cli`` (with ``serve_cli``, ``cli_runs``, ``oncall_cli``, and ``cli_args`` for the argument
  types they share): the commands' arguments; ``serve``: the composition root that builds a
  sidecar.
- ``inspect``, ``report``, ``runs_listing``, ``status_json``, ``status``: the offline gate, the
  HTML report, ``deadweight runs``, ``status --json``, the live table.
- ``exposition/``: ``/metrics`` (the collector and its HTTP server) and the runbook pages.
- ``ingest/``: the gRPC server, kernel-attested peers (``SO_PEERCRED``), who may connect.
- ``actions/``: policy (log, page, STOP, kill), the signal escalation, Alertmanager, links.
- ``checkpoints/``: the folder watcher, the safetensors inspector, the promotion gate.
- ``registry/``: runs by id, incarnation and rank: identity, events, incidents, status.
- ``verdicts``: how verdicts are listed to a person (root causes first, their states).
- ``detectors/``: small pure verdicts over a run's state, one spec each.
- ``store/``: the SQLite journal (runs, incidents, actions), its files, the report history.
- ``model/``: plain data every room reads (run state, steps, findings, limits, settings,
  inspections, process identities); ``tuning/``, ``logs``: process set-up.
"""
