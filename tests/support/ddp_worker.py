"""One rank of a real DDP job (``torchrun --nproc-per-node 2``, gloo on CPU) with the callback.

Usage: ``torchrun --nproc-per-node 2 tests/support/ddp_worker.py MODEL_DIR ADAPTER_DIR OUT_DIR MODE
[STEPS [OVERRIDES_JSON]]`` with ``DEADWEIGHT_ADDRESS`` set; MODE is ``healthy`` (adapter loaded
trainable) or ``frozen``: the optimizer holds none of the adapter's tensors (built by hand on
the frozen base weights and handed to the trainer), so gradients reach the adapter on every rank
and nothing moves. (The pure F1 mistake, an adapter loaded without ``is_trainable``, is not
silent under DDP: PyTorch refuses to wrap a model with nothing to train.) No run id is given:
every rank must report under rank 0's id. Each rank writes ``rank<N>.json`` with its own figures
so the test can compare them with what the sidecar shows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STEPS = 4


def main(model_dir: Path, adapter_dir: Path, out: Path, mode: str, steps: int = STEPS,
         overrides: dict[str, object] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    from deadweight.callbacks import DeadweightCallback
    from deadweight.callbacks.stream_client import ClientSettings
    from deadweight.demo import runs

    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    callback = DeadweightCallback(settings=ClientSettings(heartbeat_seconds=0.5),
                                  start_timeout_seconds=5.0)
    trainer = runs.sft_trainer(model, model_dir, out / "train", [callback], steps=steps,
                               save_steps=100, ddp_backend="gloo", **(overrides or {}))
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
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    model_dir, adapter_dir, out, mode = sys.argv[1:5]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else STEPS
    # Optional: training-argument overrides as JSON (e.g. an FSDP config).
    overrides = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
    sys.exit(main(Path(model_dir), Path(adapter_dir), Path(out), mode, steps, overrides))
