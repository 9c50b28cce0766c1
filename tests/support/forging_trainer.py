"""A training job that tries to forge its run's summary, run as its own process (and uid).

``python -m tests.support.forging_trainer SOCKET RUN_ID KEY FOLDER`` reports a broken run over
the sidecar's socket (attested, as the callback does: a RunStart whose optimizer holds nothing,
a few steps that move nothing, the run's end), saves an adapter in FOLDER/final and asks the
sidecar for the run's signed summary over it, which it writes there: the sidecar's truth.
Then it forges: a copy of the adapter in FOLDER/forged with that summary's verdicts and
actions taken out, signed with the sidecar's key at KEY when this process can read it, else
with a key of its own. It prints one JSON line: what opening KEY gave, whether the sidecar
signed, and which key signed the forgery. The job is the wire, as any client's, and the
callback's own summary writer (which makes the adapter's files group-readable first).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.numpy import save_file

from deadweight.callbacks.digest import AdapterDigest
from deadweight.callbacks.summary_writer import write_beside
from deadweight.proto import pb, run_summary
from deadweight.sidecar.checkpoints.inspector import inspect_path
from deadweight.sidecar.store.signing_key import key_id
from tests.support.faults import Pipe
from tests.support.raw_client import frozen_events

STEPS = 4


def read_key(path: Path) -> tuple[str, Ed25519PrivateKey | None]:
    """What opening the sidecar's private key gives this process: ("read", the key) or
    ("PermissionError: ...", None)."""
    try:
        pem = path.read_bytes()
    except OSError as err:
        return f"{type(err).__name__}: {err}", None
    key = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(key, Ed25519PrivateKey)
    return "read", key


def report_a_broken_run(socket: str, run_id: str, out: Path) -> None:
    """RunStart (an optimizer that holds none of the adapter: empty_optimizer at once),
    STEPS steps that move nothing, and the run's end."""
    pipe = Pipe(f"unix://{socket}")
    try:
        start = pb.RunStart(trainer="SFTTrainer", world_size=1, output_dir=str(out),
                            membership=pb.OptimizerMembership(
                                optimizer_params=0, trainable_params=0, adapter_params=1024,
                                adapter_tensors=2))
        answer = pipe.send(pb.StreamRequest(run_id=run_id,
                                            events=[pb.Event(seq=0, run_start=start)]))
        assert not answer.error, answer.error
        for step in range(1, STEPS + 1):
            answer = pipe.send(pb.StreamRequest(run_id=run_id,
                                                events=frozen_events(step, 2 * step - 1)))
            assert not answer.error, answer.error
        end = pb.Event(seq=2 * STEPS + 1, run_end=pb.RunEnd(step=STEPS, reason="completed"))
        answer = pipe.send(pb.StreamRequest(run_id=run_id, events=[end]))
        assert not answer.error, answer.error
    finally:
        pipe.close()


def save_adapter(folder: Path) -> Path:
    """A trained-looking LoRA adapter (B not zero) that passes the gate on its own files."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": rng.standard_normal((8, 64)).astype(np.float32),
               f"{prefix}.lora_B.weight": rng.standard_normal((64, 8)).astype(np.float32)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    # safetensors (0.8) creates its file 0600 whatever the umask: the callback's summary
    # writer grants the group read (the sidecar's way in) before it asks for a signature.
    return folder


def ask_for_the_signed_summary(socket: str, run_id: str, folder: Path) -> dict[str, Any]:
    """The sidecar's summary of the run over the adapter in folder, written there by the
    callback's own summary writer, as after the run's end (this process is the run's, bound
    by its attestation)."""
    files = inspect_path(folder)
    adapter = AdapterDigest(files.adapter_digest, dict(files.tensor_digests), files.tensor_bytes)
    written = write_beside(folder, adapter, run_id, STEPS, f"unix://{socket}", None, None,
                           timeout=10)
    assert written is not None, "no summary written"
    summary = json.loads(written.read_text())
    assert summary.get("signature"), summary.get("unsigned_because")
    body: dict[str, Any] = summary["summary"]
    return body


def main() -> int:
    socket, run_id, key_path, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    opened, sidecar_key = read_key(key_path)
    report_a_broken_run(socket, run_id, out)
    final = save_adapter(out / "final")
    body = ask_for_the_signed_summary(socket, run_id, final)
    # The forgery: the same run and bytes, its verdicts and actions gone.
    forged = out / "forged"
    shutil.copytree(final, forged)
    healthy = {**body, "verdicts": [], "actions": [], "end_reason": "completed"}
    key = sidecar_key or Ed25519PrivateKey.generate()
    run_summary.write(forged, healthy, run_summary.Signature(
        key_id(key.public_key()), key.sign(run_summary.canonical(healthy))))
    print(json.dumps({"key": opened, "verdicts": [v["detector"] for v in body["verdicts"]],
                      "forged_with": "the sidecar's key" if sidecar_key else "its own key"}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
