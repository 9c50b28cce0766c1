"""The kinds of record one ``Event`` carries: the names of its ``body`` oneof, said once.

The callback names the record it queues by kind, the sidecar dispatches on the kind it
receives; both use these members (a ``StrEnum``, so a member equals its wire name).
"""

from __future__ import annotations

from enum import StrEnum

from . import pb


class EventKind(StrEnum):
    RUN_START = "run_start"
    STEP = "step"
    LOG = "log"
    CHECKPOINT = "checkpoint"
    HEARTBEAT = "heartbeat"
    RUN_END = "run_end"


#: Members by wire name: a dict lookup, not an enum call (the sidecar asks per event).
KIND_BY_NAME: dict[str | None, EventKind] = {kind.value: kind for kind in EventKind}


def kind_of(event: pb.Event) -> EventKind | None:
    """The kind of record event carries; None for an empty event (or a newer kind)."""
    return KIND_BY_NAME.get(event.WhichOneof("body"))


__all__ = ["KIND_BY_NAME", "EventKind", "kind_of"]
