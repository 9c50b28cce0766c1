"""``deadweight demo``: catch a real silent failure end to end on a tiny local model.

It starts a real sidecar (``deadweight serve``) on a private socket, then trains twice with
GRPOTrainer (beta 0.01) on a LoRA adapter that was saved earlier:

* run A loads it with ``PeftModel.from_pretrained(base, path)``: ``is_trainable`` is left at
  False, the optimizer is built empty, and yet loss, reward and grad_norm move;
* run B, the control, loads it with ``is_trainable=True``.

The sidecar's policy for ``frozen_weights`` is ``stop``: run A is caught and stopped within a
few steps, run B trains to the end untouched. Exit status 0 means both happened.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _say(text: str) -> None:
    print(text, flush=True)


def _quiet() -> None:
    """Keep the demo's output to what it shows: the libraries' own warnings are not the story."""
    warnings.filterwarnings("ignore")
    logging.getLogger("deadweight").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    # ... but deadweight's own console lines under the Trainer (the run id and its sidecar at
    # train begin, warnings) are what a user sees: they stay (their own logger and level).
    transformers.logging.disable_progress_bar()
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()


def _tensor_bytes(path: Path) -> dict[str, bytes]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return {name: f.get_tensor(name).tobytes() for name in f.keys()}  # noqa: SIM118


def _adapter_changed(initial: Path, checkpoint_root: Path) -> tuple[str, bool] | None:
    """(checkpoint name, whether any tensor differs from the initial adapter), latest first."""
    checkpoints = sorted(checkpoint_root.glob("checkpoint-*"),
                         key=lambda p: int(p.name.split("-")[-1]))
    for checkpoint in reversed(checkpoints):
        saved = checkpoint / "adapter_model.safetensors"
        if saved.exists():
            return checkpoint.name, _tensor_bytes(saved) != _tensor_bytes(initial)
    return None


def _write_reports(state_dir: Path, workdir: Path) -> None:
    """One HTML report per run, from the sidecar's state dir (needs the report extra)."""
    try:
        from ..sidecar.commands import report
    except ImportError:
        return
    from ..sidecar.store.journal import Store

    store = Store(state_dir)
    try:
        for run_id in ("demo-frozen-adapter", "demo-healthy-control"):
            out = workdir / f"report-{run_id}.html"
            try:
                out.write_text(report.render(report.load(store, run_id)), encoding="utf-8")
            except report.ReportUnavailable as err:
                _say(f"      no report for {run_id}: {err}")
                continue
            _say(f"      report: {out}")
    finally:
        store.close()
    _say(f"      again later: deadweight report RUN_ID --state-dir {state_dir}")


def main(workdir: Path | None = None, steps: int = 12) -> int:
    """Run the demonstration; 0 when the failure was caught and the control stayed clean."""
    if workdir is None:  # kept afterwards: the checkpoints and reports it names stay readable
        workdir = Path(tempfile.mkdtemp(prefix="deadweight-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    _quiet()
    import torch
    from transformers import PrinterCallback

    torch.set_num_threads(1)
    from ..callbacks import DeadweightCallback
    from ..sidecar.commands import status
    from . import runs
    from .sidecar_process import SidecarProcess

    _say("deadweight demo: a LoRA run that reports a healthy loss while its weights stay frozen")
    _say(f"      every file goes to {workdir} and stays there (choose it with --workdir DIR)")
    _say(f"[1/5] building a tiny Qwen2-style model, tokenizer and LoRA adapter in {workdir}")
    model_dir, adapter_dir = runs.prepare(workdir / "models")

    _say("[2/5] starting the sidecar: deadweight serve --policy frozen_weights=stop "
         f"--watch-root {workdir}")
    state_dir = workdir / "sidecar" / "state"
    with SidecarProcess(workdir / "sidecar", policies={"frozen_weights": "stop"},
                        extra_args=["--state-dir", str(state_dir)],
                        watch_roots=[workdir]) as sidecar:
        _say(f"      socket {sidecar.socket_path}; while the demo runs: http://127.0.0.1:"
             f"{sidecar.metrics_port}/metrics and /runbooks/")

        _say(f"[3/5] run A: PeftModel.from_pretrained(base, adapter) -> GRPOTrainer(beta=0.01), "
             f"{steps} steps")
        frozen = runs.load_adapter(model_dir, adapter_dir, trainable=False)
        callback_a = DeadweightCallback(address=sidecar.address, run_id="demo-frozen-adapter")
        trainer_a = runs.grpo_trainer(frozen, model_dir, workdir / "run-a", [callback_a],
                                      steps=steps, save_steps=2, **runs.terminating(model_dir))
        trainer_a.remove_callback(PrinterCallback)  # the demo prints its own summary
        started = time.monotonic()
        trainer_a.train()
        grad_norms = [h["grad_norm"] for h in trainer_a.state.log_history if "grad_norm" in h]
        _say(f"      ended at step {trainer_a.state.global_step}/{steps} after "
             f"{time.monotonic() - started:.1f}s; grad_norm it logged: "
             + ", ".join(f"{g:.3g}" for g in grad_norms))

        _say("[4/5] run B (control): the same adapter loaded with is_trainable=True")
        healthy = runs.load_adapter(model_dir, adapter_dir, trainable=True)
        callback_b = DeadweightCallback(address=sidecar.address, run_id="demo-healthy-control")
        trainer_b = runs.grpo_trainer(healthy, model_dir, workdir / "run-b", [callback_b],
                                      steps=steps, save_steps=2, **runs.terminating(model_dir))
        trainer_b.remove_callback(PrinterCallback)
        trainer_b.train()
        _say(f"      ended at step {trainer_b.state.global_step}/{steps}")

        _say("[5/5] what the sidecar saw (deadweight status):")
        report = sidecar.status()
        for line in status.render(report).splitlines():
            _say("      " + line)

    runs_by_id = {r.run_id: r for r in report.runs}
    run_a = runs_by_id.get("demo-frozen-adapter")
    run_b = runs_by_id.get("demo-healthy-control")
    caught = run_a is not None and any(
        f.detector == "frozen_weights" for f in run_a.findings
    )
    stopped = trainer_a.state.global_step < steps
    control_clean = run_b is not None and not run_b.findings
    control_completed = trainer_b.state.global_step == steps
    initial = adapter_dir / "adapter_model.safetensors"
    saved_a = _adapter_changed(initial, workdir / "run-a")
    saved_b = _adapter_changed(initial, workdir / "run-b")
    if saved_a is not None:
        _say(f"      run A's {saved_a[0]}/adapter_model.safetensors differs from the initial "
             f"adapter: {saved_a[1]} (frozen: every tensor byte-identical)")
    if saved_b is not None:
        _say(f"      run B's {saved_b[0]}/adapter_model.safetensors differs from the initial "
             f"adapter: {saved_b[1]}")
    _write_reports(state_dir, workdir)
    ok = caught and stopped and control_clean and control_completed
    _say(
        "RESULT: "
        + ("frozen run caught and stopped; healthy control completed with no finding"
           if ok else
           f"unexpected: caught={caught} stopped={stopped} control_clean={control_clean} "
           f"control_completed={control_completed}")
    )
    return 0 if ok else 1
