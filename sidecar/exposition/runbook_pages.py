"""The shipped runbooks as HTML pages, so a runbook link opens even where no wiki exists.

The Markdown is package data (``deadweight/sidecar/runbooks/``, written by hand there and
linked from ``alerts/runbooks``) and is rendered by markdown-it-py with
raw HTML off. Only names of shipped runbooks resolve, so no path can leave that folder.
"""

from __future__ import annotations

import functools
import html
import re
from importlib import resources
from typing import TYPE_CHECKING

from markdown_it import MarkdownIt

if TYPE_CHECKING:  # importlib.resources.abc is new in Python 3.11
    from importlib.resources.abc import Traversable

INDEX = "README"
_NAME = re.compile(r"([a-z0-9_]+)(?:\.md)?")
_COMMENT = re.compile(r"<!--.*?-->\n?", re.S)
_STYLE = ("body{font-family:system-ui,sans-serif;max-width:52rem;margin:2rem auto;padding:0 1rem;"
          "line-height:1.5}code{background:#f3f3f3;padding:0 .2em}"
          "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3em .5em}")


def _folder() -> Traversable:
    return resources.files("deadweight.sidecar") / "runbooks"


@functools.cache
def names() -> frozenset[str]:
    """The runbooks shipped with this package (file stems), the index included."""
    return frozenset(p.name[:-3] for p in _folder().iterdir() if p.name.endswith(".md"))


def _name(path: str) -> str | None:
    """The runbook a path under /runbooks/ asks for: '' is the index; None when unknown."""
    if path == "":
        return INDEX
    match = _NAME.fullmatch(path)
    if match is None or match.group(1) not in names():
        return None
    return match.group(1)


def _markdown(name: str) -> str:
    return _COMMENT.sub("", (_folder() / f"{name}.md").read_text(encoding="utf-8"))


def body(name: str) -> str:
    """One shipped runbook as an HTML fragment (raw HTML in it stays off), '' if unknown.

    The report embeds it, so the runbook reads where no link opens."""
    if name not in names():
        return ""
    return str(MarkdownIt("commonmark", {"html": False}).enable("table").render(_markdown(name)))


@functools.cache
def _render(name: str) -> bytes:
    text = _markdown(name)
    heading = next((line[2:] for line in text.splitlines() if line.startswith("# ")), name)
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(heading)}</title><style>{_STYLE}</style></head>\n<body>\n"
        f"{body(name)}</body></html>\n"
    ).encode()


def page(path: str) -> bytes | None:
    """The HTML page for /runbooks/<path> (``<detector>`` or ``<detector>.md``), or None."""
    name = _name(path)
    return None if name is None else _render(name)
