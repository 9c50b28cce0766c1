"""A client process driven line by line from stdin, to play any party in the trust tests.

``python tests/support/trust_client.py SOCKET RUN_ID RANK [--no-attest]``, run as any uid (under
``setpriv``). Each stdin line is one JSON command; each answer is one JSON line on stdout:

- ``{"start": {"seq": 1, "output_dir": "..."}}``: a RunStart (with this process's own nonce
  unless ``--no-attest``);
- ``{"steps": [FIRST, LAST], "kind": "frozen"|"healthy", "seq": N}``: optimizer steps and their
  logs, sequence numbers from N;
- ``{"log": {"loss": "nan"}, "step": S, "seq": N}``: one log report;
- ``{"checkpoint": {"step": S, "path": "...", "digest": {"combined": ..., "tensors": {...},
  "bytes": B}}, "seq": N}``: what ``on_save`` reports of a checkpoint folder, with the adapter
  digest the callback computed in memory (optional; the sidecar's watcher reads the files);
- ``{"end": "reason", "seq": N}``: a RunEnd.

The answer is ``{"error": ..., "ack": ..., "directives": [...], "ended": CODE}``; a stream the
sidecar ended is opened again for the next command (as the callback does).

``python tests/support/trust_client.py --flood ATTEST_SOCKET [--read-replies]`` plays the flooding
attacker instead (see ``flood``); ``flood_command`` builds that command line.
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from deadweight.callbacks.stream_client import fetch_attestation
from deadweight.proto import monitor_stub, pb
from tests.support.raw_client import frozen_events, healthy_events


def attest_as(uid: int, attest_socket: str | Path) -> subprocess.CompletedProcess[str]:
    """One connection of uid (in group 0, to reach the socket) to the ``.attest`` socket; its
    stdout is the repr of what it read: ``b''`` when the sidecar closed it unanswered."""
    return subprocess.run(
        ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--groups", "0", sys.executable,
         "-c", "import socket,sys; s=socket.socket(socket.AF_UNIX); s.settimeout(30); "
         "s.connect(sys.argv[1]); print(repr(s.recv(128)))", str(attest_socket)],
        capture_output=True, text=True, timeout=60, cwd="/")


class Stream:
    def __init__(self, socket_path: str) -> None:
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        self.requests: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        self.responses = monitor_stub(self.channel).Stream(iter(self.requests.get, None))

    def send(self, request: pb.StreamRequest) -> dict[str, Any]:
        self.requests.put(request)
        try:
            response = next(self.responses)
        except grpc.RpcError as err:
            return {"error": err.details() or "", "ended": err.code().name}
        return {"error": response.error, "ack": response.ack_seq,
                "directives": [pb.Directive.Action.Name(d.action) for d in response.directives]}


def flood(path: str, read_replies: bool) -> None:
    """Eight threads connecting to the ``.attest`` socket at path without end, the newest
    connections held open. read_replies: each connection waits (2 s at most) for what the
    sidecar sends, a nonce or the close; else it only connects, non-blocking, and never reads."""
    held: list[socket.socket] = []
    keep = 500 if read_replies else 2000

    def hammer() -> None:
        while True:
            try:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                if read_replies:
                    conn.settimeout(2.0)
                else:
                    conn.setblocking(False)
                conn.connect(path)
                if read_replies:
                    conn.recv(128)
                held.append(conn)
                if len(held) > keep:
                    held.pop(0).close()
            except OSError:
                pass

    for _ in range(8):
        threading.Thread(target=hammer, daemon=True).start()
    print("flooding", flush=True)
    sys.stdin.read()


def flood_command(attest_socket: str, read_replies: bool) -> list[str]:
    """The argv of one flooding process (prefix it with ``setpriv`` for another uid; its
    environment needs the repo root on PYTHONPATH). It prints ``flooding`` once it floods."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--flood", attest_socket]
    return [*argv, "--read-replies"] if read_replies else argv


def main() -> int:
    if sys.argv[1] == "--flood":
        flood(sys.argv[2], "--read-replies" in sys.argv)
        return 0
    socket_path, run_id, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    attest = "--no-attest" not in sys.argv
    stream = Stream(socket_path)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        events: list[pb.Event] = []
        seq = int(command.get("seq", 1))
        if "start" in command:
            opts = command["start"]
            nonce = (fetch_attestation(socket_path) or "") if attest else ""
            events = [pb.Event(seq=int(opts.get("seq", seq)), run_start=pb.RunStart(
                trainer="SFTTrainer", world_size=2, output_dir=opts.get("output_dir", ""),
                attestation=nonce, sharded=bool(opts.get("sharded", False)),
                membership=pb.OptimizerMembership(optimizer_params=1000, trainable_params=1000,
                                                  adapter_params=1000, adapter_tensors=4)))]
        elif "steps" in command:
            first, last = command["steps"]
            make = frozen_events if command.get("kind") == "frozen" else healthy_events
            for step in range(first, last + 1):
                events += make(step, seq)
                seq += 2
        elif "log" in command:
            values = {k: float(v) for k, v in command["log"].items()}
            events = [pb.Event(seq=seq, time_seconds=time.time(), log=pb.LogReport(
                step=int(command.get("step", 1)), values=values))]
        elif "checkpoint" in command:
            saved = command["checkpoint"]
            digest = saved.get("digest", {})
            events = [pb.Event(seq=seq, time_seconds=time.time(), checkpoint=pb.CheckpointReport(
                step=int(saved["step"]), path=str(saved["path"]), adapter=pb.AdapterDigest(
                    combined=digest.get("combined", ""), tensors=digest.get("tensors", {}),
                    bytes=int(digest.get("bytes", 0)))))]
        elif "end" in command:
            events = [pb.Event(seq=seq, run_end=pb.RunEnd(reason=command["end"]))]
        answer = stream.send(pb.StreamRequest(run_id=run_id, rank=rank, events=events))
        if "ended" in answer:
            stream = Stream(socket_path)
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
