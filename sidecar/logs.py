"""structlog set-up: JSON lines when not on a terminal (for log shippers), readable otherwise.

Log fields often carry what a client sent (run ids, reasons, evidence, paths), so every value
is bounded before it is rendered: strings are cut at ``MAX_FIELD_CHARS``, mappings and lists
keep their first ``MAX_FIELD_ITEMS`` entries, nesting stops at ``MAX_FIELD_DEPTH``. A line
then stays within a few hundred kB whatever a client sends (a log shipper's limit is often
256 kB to 1 MB).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

#: Longest string kept in one log field (and in each entry of a mapping or list).
MAX_FIELD_CHARS = 2048
#: Most entries kept of a mapping or list in one log field.
MAX_FIELD_ITEMS = 64
#: Deepest nesting kept in one log field.
MAX_FIELD_DEPTH = 4


def bound(value: Any, depth: int = 0) -> Any:
    """value with its strings cut and its collections shortened (JSON-renderable)."""
    if isinstance(value, str):
        if len(value) > MAX_FIELD_CHARS:
            return value[:MAX_FIELD_CHARS] + f"... (+{len(value) - MAX_FIELD_CHARS} chars)"
        return value
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if depth >= MAX_FIELD_DEPTH:
        return bound(repr(value)[:MAX_FIELD_CHARS], depth)
    if isinstance(value, Mapping):
        items = list(value.items())
        kept = {bound(str(k), depth + 1): bound(v, depth + 1)
                for k, v in items[:MAX_FIELD_ITEMS]}
        if len(items) > MAX_FIELD_ITEMS:
            kept["..."] = f"+{len(items) - MAX_FIELD_ITEMS} more entries"
        return kept
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = list(value)
        kept_list = [bound(v, depth + 1) for v in seq[:MAX_FIELD_ITEMS]]
        if len(seq) > MAX_FIELD_ITEMS:
            kept_list.append(f"... +{len(seq) - MAX_FIELD_ITEMS} more entries")
        return kept_list
    return bound(str(value), depth)


def _bound_fields(logger: Any, method: str,
                  event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        if key not in ("exc_info", "exception"):  # our own traceback stays whole
            event[key] = bound(event[key])
    return event


def configure(level: str = "info", json: bool | None = None) -> None:
    """Route structlog (and stdlib logging) to stderr at level, JSON unless on a TTY."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    numeric = logging.getLevelName(level.upper())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _bound_fields,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s"
    )
