"""One real SFT run with the callback, as a user's script runs it, for the console tests.

Usage: ``python tests/support/console_worker.py MODEL_DIR ADAPTER_DIR OUT_DIR MODE ADDRESS RUN_ID
STEPS`` where MODE is ``frozen`` (the adapter loaded without ``is_trainable``) or
``healthy``, either with ``-quiet`` (the script first calls
``transformers.logging.set_verbosity_error()``, as many training scripts do). stderr carries
what the trainer's console shows (with a ``worker: step N`` line at each step end, to place
the console lines in time); the last stdout line is JSON: the
callback's ``stopped_by_deadweight``, the steps run, the ``deadweight/*`` keys the trainer's
loggers saw and the ``deadweight/*`` entries of ``trainer.state.log_history``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(model_dir: str, adapter_dir: str, out: str, mode: str, address: str, run_id: str,
         steps: str) -> None:
    from transformers import TrainerCallback

    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs

    if mode.endswith("-quiet"):
        import transformers

        transformers.logging.set_verbosity_error()
        mode = mode.removesuffix("-quiet")
    seen: dict[str, list[Any]] = {}

    class Logger(TrainerCallback):  # type: ignore[misc]
        """A logger integration's view: the keys of every log, after deadweight added its own."""

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kw: Any) -> None:
            for key, value in (logs or {}).items():
                if key.startswith("deadweight/"):
                    seen.setdefault(key, []).append(value)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            print(f"worker: step {state.global_step}", file=sys.stderr, flush=True)

    model = runs.load_adapter(Path(model_dir), Path(adapter_dir), trainable=mode == "healthy")
    callback = DeadweightCallback(address=address, run_id=run_id)
    trainer = runs.sft_trainer(model, Path(model_dir), Path(out), [callback, Logger()],
                               steps=int(steps), save_steps=int(steps))
    trainer.train()
    history = [e for e in trainer.state.log_history if any(k.startswith("deadweight/")
                                                           for k in e)]
    print(json.dumps({"stopped_by_deadweight": callback.stopped_by_deadweight,
                      "steps": trainer.state.global_step, "logged": seen,
                      "history": history}))


if __name__ == "__main__":
    main(*sys.argv[1:8])
