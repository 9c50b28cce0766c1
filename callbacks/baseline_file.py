"""The baseline a run names (``baseline=`` or ``DEADWEIGHT_BASELINE``), read on the training
side and sent with the RunStart.

The sidecar never opens a path a trainer names: the content travels over the stream, bounded
in size, and the sidecar parses it as data. Read once, when the driver is built; a missing,
unreadable or oversized file is one warning and the run is watched without a baseline.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("deadweight")

#: The environment variable that names a baseline for a script left unedited.
BASELINE_ENV = "DEADWEIGHT_BASELINE"
#: Largest baseline sent (the sidecar refuses larger; ``deadweight baseline save`` writes a
#: few kilobytes).
MAX_BASELINE_BYTES = 64 * 1024


def read(path: str | os.PathLike[str] | None) -> tuple[str, str] | None:
    """(content, file name) of the baseline named, else the environment's; None when neither
    names one or it cannot be sent (said once on the console)."""
    named = path if path is not None else os.environ.get(BASELINE_ENV) or None
    if named is None:
        return None
    file = Path(named)
    try:
        with file.open("rb") as handle:
            data = handle.read(MAX_BASELINE_BYTES + 1)
    except OSError as err:
        log.warning("deadweight: the baseline %s cannot be read (%s); this run is compared "
                    "with none", file, err.strerror or err)
        return None
    if len(data) > MAX_BASELINE_BYTES:
        log.warning("deadweight: the baseline %s is larger than %d bytes; this run is compared "
                    "with none", file, MAX_BASELINE_BYTES)
        return None
    try:
        return data.decode("utf-8"), file.name
    except UnicodeDecodeError:
        log.warning("deadweight: the baseline %s is not UTF-8 text; this run is compared with "
                    "none", file)
        return None
