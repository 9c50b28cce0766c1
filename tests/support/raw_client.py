"""A hand-built deadweight.v1 client that reports a frozen run, for the enforcement tests.

Imported for its message builders, or run as its own process
(``python tests/support/raw_client.py``) to play a client the sidecar must not trust: it can
claim another process's pid in every field it controls, ignores STOP, and never sends a run
end. With ``--attest`` it first fetches
a nonce for itself, as the real callback does.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time
from collections.abc import Iterator

import grpc

from deadweight.callbacks.stream_client import fetch_attestation
from deadweight.proto import monitor_stub, pb


def run_start(claim_pid: int = 0, attestation: str = "") -> pb.RunStart:
    """A RunStart whose every free-form field names claim_pid (when given)."""
    text = str(claim_pid) if claim_pid else ""
    return pb.RunStart(
        trainer="SFTTrainer",
        world_size=1,
        output_dir=f"/proc/{claim_pid}" if claim_pid else "/tmp/raw-client",
        config={"learning_rate": 1e-4, "pid": float(claim_pid)},
        config_text={"pid": text, "target_pid": text},
        versions={"pid": text},
        host=text or "raw-client",
        attestation=attestation or text,
        membership=pb.OptimizerMembership(optimizer_params=0, trainable_params=0,
                                          adapter_params=1000, adapter_tensors=4),
    )


def frozen_events(step: int, seq: int) -> list[pb.Event]:
    """One optimizer step that moved nothing while loss and grad_norm look alive."""
    return [
        pb.Event(seq=seq, time_seconds=time.time(), step=pb.StepReport(
            step=step, learning_rate=1e-4, update_sq_sum=0.0, param_sq_sum=1.0,
            watched_tensors=4, watched_params=1000, optimizer_params=0, unchanged_tensors=4)),
        pb.Event(seq=seq + 1, time_seconds=time.time(), log=pb.LogReport(
            step=step, values={"loss": 2.0, "grad_norm": 0.5, "learning_rate": 1e-4})),
    ]


def healthy_events(step: int, seq: int) -> list[pb.Event]:
    """One optimizer step that moved the weights at a healthy scale-free ratio."""
    return [
        pb.Event(seq=seq, time_seconds=time.time(), step=pb.StepReport(
            step=step, learning_rate=1e-4, update_sq_sum=1e-6, param_sq_sum=1.0,
            watched_tensors=4, watched_params=1000, optimizer_params=1000)),
        pb.Event(seq=seq + 1, time_seconds=time.time(), log=pb.LogReport(
            step=step, values={"loss": 2.0, "grad_norm": 0.5, "learning_rate": 1e-4})),
    ]


def checkpoint_event(step: int, seq: int, digest: str) -> pb.Event:
    return pb.Event(seq=seq, time_seconds=time.time(), checkpoint=pb.CheckpointReport(
        step=step, path=f"/tmp/raw-client/checkpoint-{step}",
        adapter=pb.AdapterDigest(combined=digest, tensors={"lora_A": digest}, bytes=4096)))


def requests(run_id: str, start: pb.RunStart, interval: float,
             rank: int = 0) -> Iterator[pb.StreamRequest]:
    """RunStart, then one frozen step every interval seconds, forever."""
    yield pb.StreamRequest(run_id=run_id, rank=rank, events=[pb.Event(seq=0, run_start=start)])
    for step in itertools.count(1):
        yield pb.StreamRequest(run_id=run_id, rank=rank,
                               events=frozen_events(step, 2 * step - 1))
        time.sleep(interval)  # the pace of a training loop, not a wait on a condition


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--claim-pid", type=int, default=0)
    parser.add_argument("--attest", action="store_true")
    parser.add_argument("--interval", type=float, default=0.05)
    args = parser.parse_args()
    nonce = fetch_attestation(args.socket) if args.attest else None
    if args.attest and nonce is None:
        print("NO_ATTESTATION", flush=True)
        return 3
    start = run_start(args.claim_pid, attestation=nonce or "")
    with grpc.insecure_channel(f"unix://{args.socket}") as channel:
        try:
            for response in monitor_stub(channel).Stream(
                requests(args.run_id, start, args.interval, args.rank)
            ):
                for directive in response.directives:
                    print(f"IGNORING {pb.Directive.Action.Name(directive.action)}", flush=True)
                if response.error:
                    print(f"ERROR {response.error}", flush=True)
        except grpc.RpcError as err:
            print(f"STREAM_ENDED {err.code().name}", flush=True)
    while True:  # stay alive until a signal ends it: the tests decide when
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
