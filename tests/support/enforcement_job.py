"""A real frozen-adapter training job (F1) for the enforcement tests, as its own process.

``--mode obey`` uses the stock callback; ``ignore_stop`` uses a callback modified to drop the
sidecar's directives; ``ignore_term`` also ignores SIGTERM, so only SIGKILL ends it. The job
prints ``TRAINING_ENDED step=N`` when training returns (STOP obeyed). ``--trainable 1`` loads
the adapter trainable: a healthy job that learns (the control beside a frozen one).
``--go-file PATH`` makes the job import, load and build everything first, then begin training
only once PATH exists: a test can start a job early and time its RunStart to the moment it
needs, without waiting out the imports (most of a minute on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--adapter-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["obey", "ignore_stop", "ignore_term"],
                        default="obey")
    parser.add_argument("--kind", choices=["sft", "grpo"], default="sft")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--save-steps", type=int, default=100_000)
    parser.add_argument("--step-pause", type=float, default=0.02)
    parser.add_argument("--trainable", type=int, default=0)
    parser.add_argument("--go-file", default="")
    args = parser.parse_args()
    if args.mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    import torch
    from transformers import TrainerCallback

    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs

    torch.set_num_threads(1)

    class DeafCallback(DeadweightCallback):
        """The stock callback, except that it reads the sidecar's directives and drops them."""

        def _apply_directives(self, control: Any, state: Any = None) -> None:
            if self.client is not None:
                for directive in self.client.take_directives():
                    print(f"IGNORING directive {directive.action}", flush=True)

    class Pace(TrainerCallback):  # type: ignore[misc]
        """Leave CPU to the rest of the machine between steps."""

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            time.sleep(args.step_pause)  # the job's pace, not a wait on a condition

    cls = DeadweightCallback if args.mode == "obey" else DeafCallback
    callback = cls(address=args.address, run_id=args.run_id, start_timeout_seconds=10.0)
    model = runs.load_adapter(Path(args.model_dir), Path(args.adapter_dir),
                              trainable=bool(args.trainable))
    build = runs.sft_trainer if args.kind == "sft" else runs.grpo_trainer
    trainer = build(model, Path(args.model_dir), Path(args.out), [callback, Pace()],
                    steps=args.steps, save_steps=args.save_steps)
    if args.go_file:
        print("READY", flush=True)
        deadline = time.monotonic() + 600
        while not Path(args.go_file).exists():  # the test's signal to begin
            if time.monotonic() > deadline:
                print("NO_GO", flush=True)
                return 3
            time.sleep(0.05)
    print("TRAINING_STARTED", flush=True)
    trainer.train()
    print(f"TRAINING_ENDED step={trainer.state.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
