"""The sidecar daemon: turns the training side's stream into verdicts, metrics, pages and stops.

Its rooms, top to bottom (a room imports only rooms below it; ``lint-imports`` checks it):

- ``cli``: the commands' arguments; ``serve``: the composition root that builds a sidecar.
- ``inspect``, ``report``, ``status``: the offline gate, the HTML report, the live table.
- ``exposition/``: ``/metrics`` (the collector and its HTTP server) and the runbook pages.
- ``ingest/``: the gRPC server, kernel-attested peers (``SO_PEERCRED``), who may connect.
- ``actions/``: policy (log, page, STOP, kill), the signal escalation, Alertmanager, links.
- ``checkpoints/``: the folder watcher, the safetensors inspector, the promotion gate.
- ``registry/``: runs by id and rank: identity, events, findings and incidents, status.
- ``detectors/``: small pure verdicts over a run's state, one spec each.
- ``store/``: the SQLite journal (runs, incidents, actions), its files, the report history.
- ``model/``: plain data every room reads (run state, steps, findings, limits, settings,
  inspections, process identities); ``tuning/``, ``logs``: process set-up.
"""
