"""structlog set-up: JSON lines when not on a terminal (for log shippers), readable otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


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
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s"
    )
