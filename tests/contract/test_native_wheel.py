"""The wheel carries the native update kernel built at install time: no compiler where it runs.

Builds the wheel from a clean copy of the source (the build backend compiles the kernel),
installs it into a fresh venv, and runs a probe there with no compiler reachable (``PATH``
without one, ``CC=/bin/false``) and an empty home: the native kernel must run, and say so.
torch and the other dependencies are reused from this interpreter (a path line in the venv),
so the test does not reinstall them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
import deadweight, torch
from deadweight.callbacks.update.probe import UpdateProbe
print("module", deadweight.__file__)
t = torch.zeros(1000)
p = UpdateProbe([t])
p.before_step()
t[:10] += 1.0
s = p.after_step()
print("path", p.path, s.update_sq_sum, s.unchanged_elements)
"""


def _copy_source(dest: Path) -> Path:
    """The source tree without build output, caches or a locally built kernel."""
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.so", "__pycache__",
                                    "*.egg-info", ".mypy_cache", ".ruff_cache", ".hypothesis")
    shutil.copytree(REPO, dest, symlinks=True, ignore=ignore)
    return dest


def _without_pythonpath() -> dict[str, str]:
    """This environment, minus a PYTHONPATH that would show the checkout to the installer."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.mark.slow
def test_wheel_runs_the_native_kernel_without_a_compiler(tmp_path: Path) -> None:
    src = _copy_source(tmp_path / "src")
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(wheels)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("deadweight-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        kernels = [n for n in archive.namelist() if "_update_kernel" in n and n.endswith(".so")]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert kernels == [f"deadweight/callbacks/update/_update_kernel{suffix}"]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--ignore-installed", "-q", str(wheel)],
        capture_output=True, text=True, timeout=300, check=False, env=_without_pythonpath(),
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    import torch

    # the dependencies come from this interpreter's site-packages, after the venv's own
    (site / "dependencies.pth").write_text(str(Path(torch.__file__).parent.parent) + "\n")

    home = tmp_path / "home"
    home.mkdir()
    bare_path = tmp_path / "bin"  # a PATH with no compiler on it
    bare_path.mkdir()
    env = {"PATH": str(bare_path), "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
           "CC": "/bin/false", "OMP_NUM_THREADS": "1"}
    assert shutil.which("gcc", path=env["PATH"]) is None
    assert shutil.which("cc", path=env["PATH"]) is None
    done = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=env,
                          cwd=home, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == f"module {site / 'deadweight' / '__init__.py'}"
    assert any(line.startswith("deadweight: update pass runs the native (installed C kernel "
                               f"{site / 'deadweight' / 'callbacks'}") for line in lines), lines
    assert lines[-1] == "path native 10.0 990"
    assert not any(home.rglob("*")), "nothing may be built or cached at run time"
