"""The socket's folder as the Kubernetes Job hands it to the sidecar, rebuilt for real.

The kubelet makes an emptyDir with ``medium: Memory`` a tmpfs mounted with nothing but its
size (its root is then 1777), and gives it to the pod's fsGroup (mode | 2770: 3777, root's). A
disk-backed emptyDir is a 0777 folder instead (2777 after fsGroup). Each folder here is made
the same way (a real tmpfs in a private mount namespace, the kubelet's chown and chmod), and
the sidecar's own socket preparation runs in it as the manifest's sidecar uid, in fsGroup.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.contract.test_deploy_manifests import container, effective_ids, job, pod_spec

pytestmark = pytest.mark.slow  # mounts a tmpfs and runs as other uids

ROOT = Path(__file__).resolve().parents[2]

#: The sidecar's socket preparation, then the folder's mode as it is left.
PREPARE = """
import stat, sys
from pathlib import Path
from deadweight.sidecar.ingest.socket_claim import prepare_socket
path = Path(sys.argv[1])
prepare_socket(path)
print("mode", oct(stat.S_IMODE(path.parent.stat().st_mode)), flush=True)
"""


def _socket_volume() -> tuple[dict[str, object], str, int, tuple[int, int]]:
    """(the socket's emptyDir, its mount path, fsGroup, the sidecar's uid and gid)."""
    spec = pod_spec(job())
    sidecar = container(spec, "deadweight")
    env = {e["name"]: e.get("value", "") for e in container(spec, "trainer")["env"]}
    socket_dir = str(Path(env["DEADWEIGHT_ADDRESS"].removeprefix("unix://")).parent)
    name = next(m["name"] for m in sidecar["volumeMounts"] if m["mountPath"] == socket_dir)
    volume = next(v for v in spec["volumes"] if v["name"] == name)
    return (volume["emptyDir"], socket_dir, int(spec["securityContext"]["fsGroup"]),
            effective_ids(spec, "deadweight"))


@pytest.fixture
def base() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="deadweight-sockdir-") as folder:  # other uids
        os.chmod(folder, 0o755)  # must reach it: pytest's own folders are closed to them
        yield Path(folder)


def _prepare_as_sidecar(folder: Path, tmpfs: bool, owner: int = 0) -> str:
    """Build folder as the kubelet would (a tmpfs or a 0777 folder, then fsGroup), owned by
    owner, and prepare the socket in it as the sidecar; the sidecar's output."""
    _, _, fs_group, (uid, gid) = _socket_volume()
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # the kubelet's setupDir, whatever the umask
    mount = f"mount -t tmpfs -o size=1048576 tmpfs {folder} && " if tmpfs else ""
    script = (f"{mount}chown {owner}:{fs_group} {folder} && chmod ug+rwx,g+s {folder} && "
              f'exec setpriv --reuid {uid} --regid {gid} --groups {fs_group} "$@"')
    done = subprocess.run(
        ["unshare", "--mount", "--", "sh", "-c", script, "sh", sys.executable, "-c", PREPARE,
         str(folder / "deadweight.sock")],
        capture_output=True, text=True, timeout=60, cwd="/",
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_manifests_socket_folder_is_safe_as_it_arrives(base: Path) -> None:
    """The Job's socket volume (tmpfs, fsGroup) arrives as 3777: every uid may add names but
    only root and the sidecar may remove or rename the sidecar's sockets. No warning."""
    volume, _, _, _ = _socket_volume()
    assert volume.get("medium") == "Memory"  # what makes the folder sticky
    output = _prepare_as_sidecar(base / "socket", tmpfs=True)
    assert "mode 0o3777" in output
    assert "socket_dir_not_private" not in output
    assert "socket_dir_made_private" not in output  # root's: nothing the sidecar may change


def test_a_disk_emptydir_is_still_warned_about(base: Path) -> None:
    """Without ``medium: Memory`` the folder is root's 2777, not sticky: any uid in the pod
    could swap the socket, and the sidecar cannot change a folder it does not own."""
    output = _prepare_as_sidecar(base / "socket", tmpfs=False)
    assert "mode 0o2777" in output
    assert "socket_dir_not_private" in output


def test_a_folder_the_sidecar_owns_is_made_private_for_the_shared_group(base: Path) -> None:
    """A folder of the sidecar's own open to every uid (2777) is closed to them: 2770, the
    trainer's group keeps its access; no warning."""
    _, _, _, (uid, _) = _socket_volume()
    output = _prepare_as_sidecar(base / "socket", tmpfs=False, owner=uid)
    assert "socket_dir_made_private" in output
    assert "mode 0o2770" in output
    assert "socket_dir_not_private" not in output
