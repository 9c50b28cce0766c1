"""Whether this sidecar may signal a trainer that runs as another uid (CAP_KILL).

The kernel lets a process signal another uid's process only with CAP_KILL in its *effective*
set. A container runtime hands a non-root container an added capability in its bounding set;
the sidecar image's interpreter carries ``cap_kill`` as a *permitted* file capability (no
effective bit, so the image still starts where KILL is not granted), so the sidecar starts with
CAP_KILL permitted where the pod adds it, and raises it to effective here, once, before any
thread exists (capabilities are per thread; threads started later inherit them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog

CAP_KILL = 5
_CAP_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
_VFS_CAP_REVISION_2 = 0x02000000


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


@dataclass(frozen=True)
class KillCapability:
    """CAP_KILL in this thread's sets, as /proc reports them."""

    effective: bool
    permitted: bool

    @property
    def state(self) -> str:
        """'effective' (other uids can be signalled), 'permitted' (not raised) or 'absent'."""
        if self.effective:
            return "effective"
        return "permitted" if self.permitted else "absent"


def _mask(status: str, field: str) -> int:
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    return 0


def kill_capability() -> KillCapability:
    """CAP_KILL as the calling thread holds it now."""
    status = Path(f"/proc/self/task/{threading.get_native_id()}/status")
    try:
        text = status.read_text()
    except OSError:
        text = Path("/proc/self/status").read_text()
    bit = 1 << CAP_KILL
    return KillCapability(effective=bool(_mask(text, "CapEff") & bit),
                          permitted=bool(_mask(text, "CapPrm") & bit))


def raise_kill() -> KillCapability:
    """Make CAP_KILL effective when it is permitted but not effective; the state after.

    Call before starting threads. Never fails: a refused capset leaves the state as it was.
    """
    found = kill_capability()
    if found.effective or not found.permitted:
        return found
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    header = _Header(_CAP_VERSION_3, 0)
    data = (_Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return found
    data[0].effective |= 1 << CAP_KILL
    libc.capset(ctypes.byref(header), data)
    return kill_capability()


def can_signal(uid: int, capability: KillCapability) -> bool:
    """True when a process of uid may be signalled by this sidecar (same uid, root, or
    CAP_KILL effective)."""
    own = os.geteuid()
    return own == 0 or uid == own or capability.effective


def announce(capability: KillCapability, trainer_uids: tuple[int, ...],
             source: str = "--trainer-uid") -> None:
    """One startup line on who may report and what a ``kill`` policy can reach; an error for
    a trainer uid it cannot signal (its SIGTERM/SIGKILL would be journaled as
    permission_denied)."""
    log = structlog.get_logger("deadweight.signal_capability")
    log.info("signal_capability", cap_kill=capability.state, uid=os.geteuid(),
             trainer_uids=list(trainer_uids), trainer_uids_from=source)
    for uid in trainer_uids:
        if not can_signal(uid, capability):
            log.error("trainer_uid_not_signalable", trainer_uid=uid, uid=os.geteuid(),
                      cap_kill=capability.state,
                      note="a kill policy can send STOP to this uid's runs but never a "
                      "signal: add the KILL capability to the sidecar")


def interpreter_of(script: Path) -> Path:
    """The interpreter a ``#!`` script names (the kernel runs that file, with its caps)."""
    with script.open("rb") as handle:
        first = handle.readline()
    if not first.startswith(b"#!"):
        raise ValueError(f"{script} is not a #! script")
    return Path(first[2:].decode().split()[0])


def grant_to_interpreter(path: Path) -> None:
    """Make path (a venv's interpreter link) a copy of the real interpreter that carries
    CAP_KILL as a permitted file capability (the image build runs this, as root).

    No effective bit: where the container's bounding set lacks KILL, the interpreter still
    starts (with the bit, the kernel would refuse to run it); ``raise_kill`` does the rest.
    """
    real = path.resolve()
    if path.is_symlink():
        path.unlink()
        shutil.copy2(real, path)
    # struct vfs_cap_data, revision 2: magic, then (permitted, inheritable) per 32-bit word.
    os.setxattr(path, "security.capability",
                struct.pack("<5I", _VFS_CAP_REVISION_2, 1 << CAP_KILL, 0, 0, 0))


if __name__ == "__main__":
    # The image build: the interpreter the entry point script runs gets the capability.
    grant_to_interpreter(interpreter_of(Path(sys.argv[1])))
