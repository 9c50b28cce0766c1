"""One rank of a real DDP job (``torchrun --nproc-per-node 2``, gloo on CPU) with the callback.

Usage: ``torchrun --nproc-per-node 2 tests/support/ddp_worker.py MODEL_DIR ADAPTER_DIR OUT_DIR MODES
[STEPS [OVERRIDES_JSON]]`` with ``DEADWEIGHT_ADDRESS`` set; MODES is one mode or several,
comma-separated, run one after the other in one launch (``main``). A mode is ``healthy``
(adapter loaded trainable) or ``frozen``: the optimizer holds none of the adapter's tensors
(built by hand on the frozen base weights and handed to the trainer), so gradients reach the
adapter on every rank and nothing moves; or ``stall``: healthy, but after step ``STALL_AFTER``
rank 1's data loading hangs (its collator waits) until the file OUT_DIR/release appears, while
rank 0 waits for it in a collective (the trainer's token-count gather before the next step).
(The pure F1 mistake, an adapter loaded without ``is_trainable``, is not silent under DDP:
PyTorch refuses to wrap a model with nothing to train.) No run id is given: every rank must
report under rank 0's id. Each rank writes ``rank<N>.json`` with its own figures so the test
can compare them with what the sidecar shows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STEPS = 4
STALL_AFTER = 2
#: Longest rank 1 stays stuck when nobody releases it (the test releases it far sooner).
STALL_LIMIT_SECONDS = 120.0


def _stuck_collator(trainer: object, out: Path) -> object:
    """Rank 1's data collator that stays stuck in the first batch it collates after step
    STALL_AFTER (a data loader hung on its shard) until released."""
    import time

    collate = trainer.data_collator  # type: ignore[attr-defined]

    def collator(rows: object) -> object:
        if trainer.state.global_step == STALL_AFTER:  # type: ignore[attr-defined]
            deadline = time.monotonic() + STALL_LIMIT_SECONDS
            while not (out / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the stuck rank: its loop makes no progress
        return collate(rows)

    return collator


def main(model_dir: Path, adapter_dir: Path, out: Path, modes: str, steps: int = STEPS,
         overrides: dict[str, object] | list[dict[str, object]] | None = None) -> int:
    """One run per mode of the comma-separated MODES, one after the other in this process
    (one import of the trainer stack); with several, run i writes to ``OUT/<i>-<mode>/`` and
    OVERRIDES may be a list, one per run."""
    import torch

    torch.set_num_threads(1)
    names = modes.split(",")
    per_run = overrides if isinstance(overrides, list) else [overrides or {}] * len(names)
    for index, (mode, extra) in enumerate(zip(names, per_run, strict=True)):
        run(model_dir, adapter_dir, out / f"{index}-{mode}" if len(names) > 1 else out, mode,
            steps, extra)
    return 0


def run(model_dir: Path, adapter_dir: Path, out: Path, mode: str, steps: int,
        overrides: dict[str, object]) -> None:
    """One Trainer run with the callback; writes this rank's report to out."""
    import torch

    from deadweight.callbacks import DeadweightCallback
    from deadweight.callbacks.stream_client import ClientSettings
    from deadweight.demo import runs

    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    callback = DeadweightCallback(settings=ClientSettings(heartbeat_seconds=0.5),
                                  start_timeout_seconds=5.0)
    trainer = runs.sft_trainer(model, model_dir, out / "train", [callback], steps=steps,
                               save_steps=100, ddp_backend="gloo", **overrides)
    if mode == "stall" and int(os.environ["RANK"]) == 1:
        trainer.data_collator = _stuck_collator(trainer, out)
    if mode == "frozen":
        base = [p for name, p in model.named_parameters() if "lora_" not in name]
        trainer.optimizer = torch.optim.AdamW(base[:2], lr=trainer.args.learning_rate)
    trainer.train()
    client = callback.client
    assert client is not None
    rank = int(os.environ["RANK"])
    report = {
        "rank": rank,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "run_id": callback.run_id,
        "process_index": trainer.args.process_index,
        "global_step": trainer.state.global_step,
        "submitted": client.submitted,
        "dropped": client.dropped,
        "connects": client.connects,
        "wrapper": callback._run.layout.wrapper if callback._run.layout else "",
        "sharded": callback._run.layout.sharded if callback._run.layout else False,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    model_dir, adapter_dir, out, mode = sys.argv[1:5]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else STEPS
    # Optional: training-argument overrides as JSON (e.g. an FSDP config), or a list of them.
    overrides = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
    sys.exit(main(Path(model_dir), Path(adapter_dir), Path(out), mode, steps, overrides))
