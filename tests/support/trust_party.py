"""One party of the trust and identity tests: a ``trust_client.py`` process driven line by line,
optionally under another uid (``setpriv``), against a real ``deadweight serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from deadweight.demo.sidecar_process import SidecarProcess

ROOT = Path(__file__).resolve().parents[2]


class Client:
    """One party: a trust_client.py process, optionally under another uid."""

    def __init__(self, sidecar: SidecarProcess, run_id: str, rank: int = 0,
                 uid: int | None = None, attest: bool = True) -> None:
        argv = [sys.executable, str(ROOT / "tests" / "support" / "trust_client.py"),
                str(sidecar.socket_path), run_id, str(rank)]
        if not attest:
            argv.append("--no-attest")
        if uid is not None:  # another uid, in the socket's group (as the attacker)
            argv = ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--groups", "0",
                    *argv]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd="/")
        assert json.loads(self._line()) == {"ready": True}

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"client exited with {self.proc.poll()}"
        return line

    def do(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self._line())
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)
