"""The promotion gate catches what the run knew, and verifies what it trusts.

Real SFT runs against a real ``deadweight serve`` (with a state dir, so its signing key is
kept there), real ``trainer.save_model(dir)`` after training, and ``deadweight inspect`` run
as a command. The day-2 case: day 1 trains an adapter; day 2 reloads it with
``PeftModel.from_pretrained`` (is_trainable left False), trains with ``save_strategy="no"``
and saves with ``trainer.save_model(out/"final")``: the gate must fail that adapter naming
the root cause, and pass its healthy twin. Then the attacks on the gate, each for real:
deleting the summary, editing its verdicts out, replaying a healthy run's summary with the
digests recomputed, re-signing with another key, asking the sidecar to sign from a process
that is not the run's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import run_summary

if TYPE_CHECKING:
    from deadweight.callbacks.digest import AdapterDigest

pytestmark = pytest.mark.slow

SUMMARY = run_summary.FILE_NAME


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, Path]]:
    """A real sidecar with a state dir; (the process, its public key file)."""
    folder = tmp_path_factory.mktemp("gate-sidecar")
    state = folder / "state"
    with SidecarProcess(folder, extra_args=["--state-dir", str(state)]) as process:
        yield process, state / "summary-signing.pub"


def _train(model: Any, model_dir: Path, out: Path, sidecar: SidecarProcess, run_id: str,
           steps: int = 6, lr: float = 2e-4) -> Path:
    """One real SFT run that saves nothing itself; the script's save_model(out/final)."""
    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs

    trainer = runs.sft_trainer(
        model, model_dir, out, [DeadweightCallback(address=sidecar.address, run_id=run_id)],
        steps=steps, lr=lr, save_strategy="no")
    trainer.train()
    trainer.save_model(str(out / "final"))  # after on_train_end: no callback hook fires
    return out / "final"


@pytest.fixture(scope="module")
def day2(tiny: tuple[Path, Path], signing: tuple[SidecarProcess, Path],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Day 1 trains an adapter; day 2 resumes it frozen (the mistake) and trainable."""
    from deadweight.demo import runs

    sidecar, _ = signing
    model_dir, adapter_dir = tiny
    folder = tmp_path_factory.mktemp("day2")
    day1 = _train(runs.load_adapter(model_dir, adapter_dir, trainable=True), model_dir,
                  folder / "day1", sidecar, "gate-day1")
    frozen = _train(runs.load_adapter(model_dir, day1, trainable=False), model_dir,
                    folder / "frozen", sidecar, "gate-day2-frozen")
    healthy = _train(runs.load_adapter(model_dir, day1, trainable=True), model_dir,
                     folder / "healthy", sidecar, "gate-day2-healthy")
    return {"day1": day1, "frozen": frozen, "healthy": healthy, "model": model_dir}


def inspect(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadweight.cli", "inspect", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def strict(key: Path) -> list[str | Path]:
    return ["--trust-key", key, "--require-signed", "--require-summary"]


def _copy_adapter(source: Path, target: Path, with_summary: bool = True) -> Path:
    shutil.copytree(source, target)
    if not with_summary:
        (target / SUMMARY).unlink()
    return target


def test_day2_frozen_resume_fails_the_gate_and_its_healthy_twin_passes(
    day2: dict[str, Path], signing: tuple[SidecarProcess, Path]
) -> None:
    sidecar, key = signing
    document = json.loads((day2["frozen"] / SUMMARY).read_text())
    assert document["signature"]["algorithm"] == "ed25519"  # beside save_model's adapter
    assert document["summary"]["ended"] is True
    # The verdicts are the sidecar's own, every one of them, root cause first.
    status = sidecar.run_status("gate-day2-frozen")
    assert status is not None
    listed = [v["detector"] for v in document["summary"]["verdicts"]]
    assert sorted(listed) == sorted(f.detector for f in status.findings)
    assert listed[:2] == ["empty_optimizer", "frozen_weights"]

    frozen = inspect(day2["frozen"], *strict(key))
    assert frozen.returncode == 1, frozen.stdout + frozen.stderr
    out = frozen.stdout
    assert f"FAIL  {day2['frozen']}" in out
    assert "empty_optimizer (firing at end" in out and "frozen_weights (firing at end" in out
    # The step each verdict fired at, then its latest reading: one moment each.
    assert "empty_optimizer (firing at end, critical): fired at step 0; latest: " in out
    assert out.index("empty_optimizer (") < out.index("frozen_weights (")  # cause first
    # Each verdict says what to do, in the detector's own words (the console's fix).
    cause = out.index("empty_optimizer (")
    assert out.index("fix: Load the adapter with `PeftModel.from_pretrained(base, path, "
                     "is_trainable=True)`", cause) < out.index("frozen_weights (")
    assert "resolved" not in out

    healthy = inspect(day2["healthy"], *strict(key))
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert f"ok    {day2['healthy']}" in healthy.stdout
    assert "run_has_" not in healthy.stdout
    # Without any flag, the frozen adapter still fails: the summary is found and read.
    assert inspect(day2["frozen"]).returncode == 1


def test_the_signing_key_is_private_and_named_in_the_start_log(
    signing: tuple[SidecarProcess, Path]
) -> None:
    sidecar, key = signing
    private = key.with_name("summary-signing.key")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.stat().st_uid == os.geteuid()
    line = next(json.loads(x) for x in sidecar.log_path.read_text().splitlines()
                if '"summary_signing_key"' in x)
    assert line["public_key"] == str(key) and line["persistent"] is True


def test_deleting_the_summary_fails_under_require_summary(
    day2: dict[str, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    _, key = signing
    bare = _copy_adapter(day2["frozen"], tmp_path / "bare", with_summary=False)
    lenient = inspect(bare)
    assert lenient.returncode == 0  # the files alone: yesterday's trained adapter, bit for bit
    assert f"no {SUMMARY} beside this adapter" in lenient.stdout
    refused = inspect(bare, *strict(key))
    assert refused.returncode == 1, refused.stdout
    assert "summary_missing [critical]" in refused.stdout


def test_editing_the_verdicts_out_breaks_the_signature(
    day2: dict[str, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    _, key = signing
    edited = _copy_adapter(day2["frozen"], tmp_path / "edited")
    document = json.loads((edited / SUMMARY).read_text())
    assert document["summary"]["verdicts"]
    document["summary"]["verdicts"] = []
    document["summary"]["actions"] = []
    (edited / SUMMARY).write_text(json.dumps(document))
    unchecked = inspect(edited)
    assert "signature not checked (no --trust-key)" in unchecked.stdout
    result = inspect(edited, *strict(key))
    assert result.returncode == 1, result.stdout
    assert "summary_tampered [critical]" in result.stdout


def _recompute_digests(folder: Path) -> dict[str, Any]:
    """The healthy run's summary with this adapter's digests, from the public inspector."""
    from deadweight.sidecar.checkpoints.inspector import inspect_path

    inspection = inspect_path(folder)
    document: dict[str, Any] = json.loads((folder / SUMMARY).read_text())
    document["summary"]["adapter_tensors"] = dict(inspection.tensor_digests)
    document["summary"]["adapter_digest"] = inspection.adapter_digest
    return document


def test_replaying_a_healthy_summary_with_recomputed_digests_fails(
    day2: dict[str, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from deadweight.sidecar.store.signing_key import key_id, public_pem

    _, key = signing
    replay = _copy_adapter(day2["frozen"], tmp_path / "replay", with_summary=False)
    shutil.copy(day2["healthy"] / SUMMARY, replay / SUMMARY)
    assert inspect(replay, *strict(key)).returncode == 1  # the digests give it away
    document = _recompute_digests(replay)
    (replay / SUMMARY).write_text(json.dumps(document))
    result = inspect(replay, *strict(key))
    assert result.returncode == 1, result.stdout
    assert "summary_tampered [critical]" in result.stdout

    # Re-signed with the attacker's own key: valid, but not a key the gate trusts.
    attacker = Ed25519PrivateKey.generate()
    body = run_summary.canonical(document["summary"])
    document["signature"] = {"algorithm": "ed25519", "key_id": key_id(attacker.public_key()),
                             "value": __import__("base64").b64encode(attacker.sign(body))
                             .decode()}
    (replay / SUMMARY).write_text(json.dumps(document))
    resigned = inspect(replay, *strict(key))
    assert resigned.returncode == 1 and "summary_untrusted_key [critical]" in resigned.stdout
    (tmp_path / "attacker.pub").write_bytes(public_pem(attacker.public_key()))
    # Control: the signature itself is sound; only trust decides.
    assert inspect(replay, "--trust-key", tmp_path / "attacker.pub").returncode == 0

    document["signature"] = None  # stripped: unsigned
    (replay / SUMMARY).write_text(json.dumps(document))
    stripped = inspect(replay, *strict(key))
    assert stripped.returncode == 1 and "summary_unsigned [critical]" in stripped.stdout


ASK_FOR_A_SIGNATURE = """
import sys
import grpc
from deadweight.callbacks.stream_client import fetch_attestation
from deadweight.proto import monitor_stub, pb
from deadweight.proto.transport import open_channel
socket_path, run_id, folder = sys.argv[1], sys.argv[2], sys.argv[3]
nonce = fetch_attestation(socket_path)
assert nonce, "no nonce"
with open_channel("unix://" + socket_path) as channel:
    try:
        monitor_stub(channel).SignSummary(pb.SignSummaryRequest(
            run_id=run_id, attestation=nonce, step=1, path=folder,
            adapter=pb.AdapterDigest(combined="x", tensors={"a": "b"})), timeout=10)
        print("SIGNED")
    except grpc.RpcError as err:
        print(err.code().name, err.details())
"""


def _claim(folder: Path) -> AdapterDigest:
    """The digest of an adapter folder's files, as the callback's in-memory digest of the
    adapter it just saved there reads."""
    from deadweight.callbacks.digest import AdapterDigest
    from deadweight.sidecar.checkpoints.inspector import inspect_path

    files = inspect_path(folder)
    return AdapterDigest(files.adapter_digest, dict(files.tensor_digests), files.tensor_bytes)


def test_only_the_runs_own_process_gets_its_summary_signed(
    day2: dict[str, Path], signing: tuple[SidecarProcess, Path]
) -> None:
    from deadweight.callbacks.summary_writer import fetch_signed

    sidecar, _ = signing
    other = subprocess.run(
        [sys.executable, "-c", ASK_FOR_A_SIGNATURE, str(sidecar.socket_path),
         "gate-day2-healthy", str(day2["healthy"])], capture_output=True, text=True,
        timeout=120)
    assert other.stdout.startswith("PERMISSION_DENIED"), other.stdout + other.stderr
    assert "is not a process of run" in other.stdout
    # Control: this process trained the run (its attested identity is bound to it), and
    # names the folder it saved and that folder's bytes.
    healthy = day2["healthy"]
    body, signature, why = fetch_signed(sidecar.address, "gate-day2-healthy", None, None,
                                        _claim(healthy), 1, timeout=5.0, folder=healthy)
    assert body is not None and signature is not None, why
    assert body["run_id"] == "gate-day2-healthy"
    assert body["adapter_digest"] == _claim(healthy).combined


def test_the_runs_own_process_gets_no_signature_over_a_digest_its_files_do_not_have(
    day2: dict[str, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path,
    caplog: pytest.LogCaptureFixture
) -> None:
    """The forgery: the healthy run's own process asks for its summary over the frozen
    adapter's digest (to lay a healthy signed summary beside the frozen adapter), naming its
    own healthy folder, or no folder at all. The sidecar reads the files itself: no
    signature, the summary is written unsigned saying why, and the strict gate fails it. The
    honest save beside the same bytes still signs and passes."""
    from deadweight.callbacks.digest import AdapterDigest
    from deadweight.callbacks.summary_writer import fetch_signed, write_beside

    sidecar, key = signing
    run = "gate-day2-healthy"
    frozen_claim = _claim(day2["frozen"])
    assert frozen_claim.combined != _claim(day2["healthy"]).combined
    forged = _copy_adapter(day2["healthy"], tmp_path / "forged", with_summary=False)
    with caplog.at_level(logging.WARNING, logger="deadweight"):
        path = write_beside(forged, frozen_claim, run, 6, sidecar.address, None, None, 10.0)
    assert path is not None
    # Beside a real adapter, an unsigned summary is said, naming that adapter's folder (the
    # run's first such warning: its training wrote none about its output folder).
    warned = [r.getMessage() for r in caplog.records if "is not signed" in r.getMessage()]
    assert len(warned) == 1 and f"the summary beside {forged} is not signed" in warned[0], warned
    document = json.loads(path.read_text())
    assert document["signature"] is None
    assert "refused" in document["unsigned_because"]
    assert "not the" in document["unsigned_because"] and "claims" in document[
        "unsigned_because"], document["unsigned_because"]
    gate = inspect(forged, *strict(key))
    assert gate.returncode == 1, gate.stdout
    assert "summary_unsigned [critical]" in gate.stdout
    # A made-up digest, and a request naming no folder (an older callback): none signed.
    for claim, folder in ((AdapterDigest("x", {"a": "b"}), forged), (frozen_claim, None)):
        body, signature, why = fetch_signed(sidecar.address, run, None, None, claim, 6,
                                            timeout=5.0, folder=folder)
        assert body is None and signature is None and "refused" in why, why
    refused = [json.loads(x) for x in sidecar.log_path.read_text().splitlines()
               if '"summary_refused"' in x]
    assert any("digest to" in line["reason"] for line in refused), refused
    assert any("names no adapter folder" in line["reason"] for line in refused), refused
    assert sidecar.run_status(run) is not None  # the run is untouched

    # The honest save beside the very same bytes: signed, and the strict gate passes it.
    honest = _copy_adapter(day2["healthy"], tmp_path / "honest", with_summary=False)
    path = write_beside(honest, _claim(honest), run, 6, sidecar.address, None, None, 10.0)
    assert path is not None and json.loads(path.read_text())["signature"] is not None
    passed = inspect(honest, *strict(key))
    assert passed.returncode == 0, passed.stdout


def test_a_stopped_run_fails_the_gate(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from deadweight.demo import runs

    model_dir, adapter_dir = tiny
    state = tmp_path / "state"
    with SidecarProcess(tmp_path / "sidecar", policies={"frozen_weights": "stop"},
                        extra_args=["--state-dir", str(state)]) as sidecar:
        final = _train(runs.load_adapter(model_dir, adapter_dir, trainable=False), model_dir,
                       tmp_path / "out", sidecar, "gate-stopped", steps=40)
    summary = json.loads((final / SUMMARY).read_text())["summary"]
    assert summary["end_reason"] == "stopped" and summary["step"] < 40
    result = inspect(final, "--trust-key", state / "summary-signing.pub", "--require-signed")
    assert result.returncode == 1, result.stdout
    assert "run_stopped [critical]" in result.stdout


def test_warnings_are_listed_and_fail_with_fail_on_warning(
    tiny: tuple[Path, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    from deadweight.demo import runs

    sidecar, key = signing
    model_dir, adapter_dir = tiny
    final = _train(runs.load_adapter(model_dir, adapter_dir, trainable=True), model_dir,
                   tmp_path / "out", sidecar, "gate-lr-low", lr=1e-6)
    listed = inspect(final, *strict(key))
    assert listed.returncode == 0, listed.stdout
    assert f"WARN  {final}" in listed.stdout
    assert "run_has_warning_verdict [warning]: lora_lr_too_low (firing at end" in listed.stdout
    fatal = inspect(final, *strict(key), "--fail-on", "warning")
    assert fatal.returncode == 1, fatal.stdout
    assert f"FAIL  {final}" in fatal.stdout


def test_an_adapter_saved_without_its_embedding_layers_is_signed_and_passes(
    tiny: tuple[Path, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    """LoRA on the embeddings: PEFT saves the base embedding layers by default (the gate's
    adapter_bloat); users are told to save with ``save_embedding_layers=False``. The summary
    describes the files that save wrote, so the sidecar signs it and the strict gate passes
    it; either adapter under the other's summary fails as not what the run produced."""
    from peft import get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs

    sidecar, key = signing
    model_dir, _ = tiny
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           runs.lora_config([*runs.LORA_TARGETS, "embed_tokens"]))
    out = tmp_path / "out"
    trainer = runs.sft_trainer(
        model, model_dir, out, [DeadweightCallback(address=sidecar.address,
                                                   run_id="gate-head-lora")],
        steps=3, save_strategy="no")
    trainer.train()
    lean, full = out / "lean", out / "full"
    trainer.model.save_pretrained(lean, save_embedding_layers=False)
    trainer.model.save_pretrained(full)  # "auto": the embeddings' base weights are written too
    names = {}
    for folder in (lean, full):
        with safe_open(folder / "adapter_model.safetensors", "pt") as weights:
            names[folder] = set(weights.keys())
    assert names[lean] < names[full]  # the flag really left tensors out
    for folder in (lean, full):
        document = json.loads((folder / SUMMARY).read_text())
        assert document["signature"] is not None, document.get("unsigned_because")
        assert set(document["summary"]["adapter_tensors"]) == names[folder]
    passed = inspect(lean, *strict(key))
    assert passed.returncode == 0, passed.stdout
    assert f"ok    {lean}" in passed.stdout
    bloated = inspect(full, *strict(key))  # its own files fail it, not its summary
    assert bloated.returncode == 1, bloated.stdout
    assert "adapter_bloat [warning]" in bloated.stdout
    assert "adapter_not_what_the_run_produced" not in bloated.stdout
    assert "signature verified" in bloated.stdout
    # Each adapter under the other's summary: not the bytes the summary describes.
    for adapter, summary_of in ((lean, full), (full, lean)):
        swapped = _copy_adapter(adapter, tmp_path / f"{adapter.name}-under-{summary_of.name}",
                                with_summary=False)
        shutil.copy(summary_of / SUMMARY, swapped / SUMMARY)
        failed = inspect(swapped, *strict(key))
        assert failed.returncode == 1, failed.stdout
        assert "adapter_not_what_the_run_produced [critical]" in failed.stdout


def test_the_summary_up_the_folders_is_found(
    day2: dict[str, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    """An adapter without its own summary, inside the run's output folder that has one."""
    _, key = signing
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(day2["frozen"] / SUMMARY, out / SUMMARY)
    nested = _copy_adapter(day2["frozen"], out / "exported" / "adapter", with_summary=False)
    result = inspect(nested, *strict(key))
    assert result.returncode == 1, result.stdout
    assert f"run summary from {out / SUMMARY}" in result.stdout
    assert "empty_optimizer (firing at end" in result.stdout


def test_the_signing_key_survives_a_restart_and_a_readable_one_is_refused(
    tmp_path: Path
) -> None:
    state = tmp_path / "state"
    args = ["--state-dir", str(state)]
    with SidecarProcess(tmp_path / "one", extra_args=args):
        first = (state / "summary-signing.pub").read_bytes()
    with SidecarProcess(tmp_path / "two", extra_args=args):
        assert (state / "summary-signing.pub").read_bytes() == first  # the same key
    (state / "summary-signing.key").chmod(0o644)
    refused = SidecarProcess(tmp_path / "three", extra_args=args)
    with pytest.raises(RuntimeError, match="group or others may read the signing key"):
        refused.start()


def _raw_loop(model_dir: Path, adapter_dir: Path, sidecar: SidecarProcess, run_id: str,
              out: Path, frozen: bool) -> Path:
    """A raw PyTorch loop under ``deadweight.watch``; the adapter saved after the loop."""
    import torch
    from transformers import AutoTokenizer

    import deadweight
    from deadweight.demo import runs

    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    # The frozen twin's optimizer holds none of the model's parameters: nothing ever moves.
    params = [torch.nn.Parameter(torch.zeros(1))] if frozen else trained
    optimizer = torch.optim.AdamW(params, lr=2e-3)
    batch = AutoTokenizer.from_pretrained(model_dir)(["a tiny line to learn"] * 2,
                                                     return_tensors="pt")
    with deadweight.watch(model, optimizer, run_id=run_id, address=sidecar.address,
                          output_dir=str(out)) as monitor:
        for step in range(1, 7):
            loss = model(**batch, labels=batch["input_ids"]).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss, grad_norm=norm, learning_rate=2e-3)
    model.save_pretrained(out / "final")  # after the loop, the way scripts end
    return out / "final"


@pytest.mark.parametrize("frozen", [True, False])
def test_a_raw_loop_adapter_saved_after_the_loop_carries_its_summary(
    frozen: bool, tiny: tuple[Path, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    sidecar, key = signing
    model_dir, adapter_dir = tiny
    final = _raw_loop(model_dir, adapter_dir, sidecar, f"gate-raw-{frozen}", tmp_path / "out",
                      frozen)
    assert json.loads((final / SUMMARY).read_text())["signature"] is not None
    result = inspect(final, *strict(key))
    if frozen:
        assert result.returncode == 1, result.stdout
        # The root cause, not its symptom (frozen weights): gradients no optimizer holds.
        assert "grad_not_in_optimizer (firing at end" in result.stdout
    else:
        assert result.returncode == 0, result.stdout


def test_the_save_wrapper_writes_once_keeps_the_model_picklable_and_spares_copies(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    import copy
    import pickle

    import torch
    from safetensors.torch import load_file

    from deadweight.callbacks.summary_writer import SummaryOnSave
    from deadweight.demo import runs

    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    written: list[tuple[Path, Any]] = []
    for _ in range(2):  # a second run's callback on the same model replaces, never stacks
        SummaryOnSave(lambda folder, saved, _: written.append((folder, saved))).install(model)
    model.save_pretrained(tmp_path / "a")
    assert [(f, m is model) for f, m in written] == [(tmp_path / "a", True)]

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if "lora_B" in name:
                param.add_(1.0)
    twin.save_pretrained(tmp_path / "b")  # the copy's own weights, and no summary of ours
    assert len(written) == 1
    a = load_file(tmp_path / "a" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert pickle.loads(pickle.dumps(model)) is not None  # no closure on the instance


def test_a_clean_run_cannot_launder_a_critical_runs_adapter(
    day2: dict[str, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    """Laundering: a second run of the same uid (the healthy day-2 run, bound to this
    process) asks for its clean summary over a frozen run's adapter folder, naming the bytes
    truly there. It used to be signed, and the frozen adapter then passed the strict gate.
    The sidecar now refuses: another run produced those bytes first and this one did not
    start from them."""
    from deadweight.callbacks.summary_writer import write_beside
    from deadweight.demo import runs

    sidecar, key = signing
    model_dir = day2["model"]
    fresh = runs.prepare(tmp_path / "fresh-models", "qwen2")[1]
    frozen = _train(runs.load_adapter(model_dir, fresh, trainable=False), model_dir,
                    tmp_path / "frozen", sidecar, "gate-launder-frozen")
    assert inspect(frozen, *strict(key)).returncode == 1  # its own summary fails it
    launder = _copy_adapter(frozen, tmp_path / "launder", with_summary=False)
    path = write_beside(launder, _claim(launder), "gate-day2-healthy", 6, sidecar.address,
                        None, None, 10.0)
    assert path is not None
    document = json.loads(path.read_text())
    assert document["signature"] is None, document
    why = document["unsigned_because"]
    # The first run that wrote these bytes and drew a critical verdict: the frozen run (or an
    # earlier frozen run of this module over the same, deterministic, bytes).
    assert "with a critical verdict" in why and "did not start from it" in why, why
    assert "'gate-day2-healthy' did not" in why and "is the one run 'gate-day2-healthy'" not in why
    gate = inspect(launder, *strict(key))
    assert gate.returncode == 1 and "summary_unsigned [critical]" in gate.stdout, gate.stdout


def test_a_summary_signed_while_the_run_was_healthy_cannot_be_replayed_after_it_froze(
    tiny: tuple[Path, Path], signing: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    """Replay: the summary signed at step 6 while the run was healthy, copied back beside the
    same adapter bytes after the run froze, used to pass the strict gate (the final summary
    fails it). A summary taken while the run was live is now refused under --require-signed:
    only one signed at or after the run's end passes."""
    import torch
    from transformers import AutoTokenizer

    import deadweight
    from deadweight.demo import runs

    sidecar, key = signing
    model_dir, adapter_dir = tiny
    out = tmp_path / "out"
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=2e-3)
    batch = AutoTokenizer.from_pretrained(model_dir)(["a tiny line to learn"] * 2,
                                                     return_tensors="pt")
    with deadweight.watch(model, optimizer, run_id="gate-replay", address=sidecar.address,
                          output_dir=str(out)) as monitor:
        for step in range(1, 17):
            if step == 7:  # from here on the optimizer holds nothing of the model
                model.save_pretrained(out / "step6")  # a live save: its summary is signed
                optimizer.param_groups[0]["params"] = [torch.nn.Parameter(torch.zeros(1))]
            loss = model(**batch, labels=batch["input_ids"]).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            model.zero_grad()
            monitor.log(step, loss=loss, grad_norm=norm, learning_rate=2e-3)
    model.save_pretrained(out / "final")
    live = json.loads((out / "step6" / SUMMARY).read_text())
    assert live["signature"] is not None and live["summary"]["ended"] is False
    assert not [v for v in live["summary"]["verdicts"] if v["severity"] == "critical"]
    final = inspect(out / "final", *strict(key))
    assert final.returncode == 1, final.stdout  # the run's final verdicts fail it
    assert _claim(out / "final").combined == _claim(out / "step6").combined  # same bytes
    shutil.copy(out / "step6" / SUMMARY, out / "final" / SUMMARY)
    replayed = inspect(out / "final", *strict(key))
    assert replayed.returncode == 1, replayed.stdout
    assert "summary_not_final [critical]" in replayed.stdout
    # Without --require-signed the live summary is read, and said to be live.
    assert "taken while run gate-replay was live" in inspect(out / "final").stdout
