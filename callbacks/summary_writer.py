"""Write the run summary a promotion gate checks (``deadweight inspect``) beside every adapter.

Every save of the adapter writes ``deadweight-summary.json`` beside it: a checkpoint's while
the run is live, the folder of a script's ``trainer.save_model(dir)`` after training (no
callback hook fires for that save: it comes after ``on_train_end``), and, at train end, the
output folder and the last checkpoint again with the run's final verdicts. The saves are
caught by wrapping the model's own ``save_pretrained`` on the instance at train begin
(``SummaryOnSave``): the Trainer's ``_save`` and a user's direct call both go through it, so
no save path is missed and no Trainer method is patched.

The summary itself comes from the sidecar (``SignSummary``): the callback sends the folder it
saved to, the digest of the adapter in memory and a fresh attestation nonce; the sidecar reads
the files there itself, signs only if they are those bytes, and fills in the verdicts,
actions and end reason from its own state and signs. When it cannot (no sidecar, TCP, an old
sidecar), the summary is written unsigned with the verdicts of ``Status`` and the reason, so
a gate can tell "no verdict" from "no problem". The output folder at train end often holds
no adapter (only ``checkpoint-*`` folders): its summary is the run's record, unsigned without
asking (the sidecar signs only adapter files it read) and without a warning, which is kept
for an adapter a gate would refuse. Asking takes at most ``timeout`` seconds.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from ..proto import monitor_stub, pb, run_summary
from ..proto.run_summary import RunSummary, Signature, SummaryVerdict
from ..proto.transport import (
    bearer_metadata,
    grpc_target,
    open_channel,
    unix_socket_path,
)
from .digest import AdapterDigest, EmbeddingLayers
from .file_access import share_with_group
from .stream_client import fetch_attestation

log = logging.getLogger("deadweight")




def _call(address: str, token: str | None, tls_root: bytes | None, timeout: float,
          method: str, request: Any) -> Any:
    with open_channel(grpc_target(address), tls_root) as channel:
        return getattr(monitor_stub(channel), method)(
            request, timeout=timeout, metadata=bearer_metadata(token))


#: Codes that mean no sidecar answered; any other is the sidecar's own answer.
_UNREACHED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _why(err: grpc.RpcError, when: str) -> str:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else ""
    if code is not None and code not in _UNREACHED:
        return f"the sidecar refused {when} ({code.name}{': ' + details if details else ''})"
    return f"sidecar unreachable {when} ({code}{': ' + details if details else ''})"


def fetch_signed(address: str, run_id: str, token: str | None, tls_root: bytes | None,
                 adapter: AdapterDigest, step: int, timeout: float, folder: Path | None = None
                 ) -> tuple[dict[str, Any] | None, Signature | None, str]:
    """(body, signature, "") from the sidecar, or (None, None, why it did not sign). The
    sidecar reads the adapter files in folder itself and signs only if they are adapter's."""
    path = unix_socket_path(grpc_target(address))
    if path is None:
        return None, None, "the sidecar signs summaries over its unix socket only"
    nonce = fetch_attestation(path, timeout=timeout, attempts=2)
    if nonce is None:
        return None, None, "no attestation from the sidecar"
    request = pb.SignSummaryRequest(
        run_id=run_id, attestation=nonce, step=step,
        path=str(folder.absolute()) if folder is not None else "",
        adapter=pb.AdapterDigest(combined=adapter.combined, tensors=adapter.tensors,
                                 bytes=adapter.bytes))
    try:
        signed: pb.SignSummaryResponse = _call(address, token, tls_root, timeout, "SignSummary",
                                         request)
    except grpc.RpcError as err:
        return None, None, _why(err, "for the signed summary")
    try:
        body = json.loads(signed.body.decode("utf-8"))
    except ValueError as err:
        return None, None, f"the sidecar's summary is not JSON ({err})"
    return body, Signature(key_id=signed.key_id, value=bytes(signed.signature)), ""


def fetch_verdicts(address: str, run_id: str, token: str | None, tls_root: bytes | None,
                   timeout: float) -> tuple[pb.RunStatus | None, str]:
    """(the run's status, "answered") or (None, why it is missing)."""
    try:
        response: pb.StatusResponse = _call(address, token, tls_root, timeout, "Status",
                                            pb.StatusRequest(run_id=run_id))
    except grpc.RpcError as err:
        return None, _why(err, "for the run's verdicts")
    run = next((r for r in response.runs if r.run_id == run_id), None)
    return (run, "answered") if run is not None else (None, "the sidecar does not know the run")


def unsigned_summary(run_id: str, step: int, adapter: AdapterDigest,
                     status: pb.RunStatus | None, sidecar: str) -> RunSummary:
    """What the callback can say without the sidecar's signature (a gate flags it)."""
    verdicts = [] if status is None else [
        SummaryVerdict(f.detector, f.severity, f.firing, int(f.step), f.summary,
                       policy=f.policy)
        for f in status.findings]
    actions = [] if status is None else [
        {"detector": a.detector, "action": a.action, "result": a.result} for a in status.actions]
    return RunSummary(run_id=run_id, step=step, adapter_tensors=dict(adapter.tensors),
                      adapter_digest=adapter.combined, sidecar=sidecar,
                      end_reason="" if status is None else status.end_reason,
                      verdicts=verdicts, actions=actions,
                      ended=False if status is None else status.ended,
                      baseline="" if status is None else status.baseline)


#: The weights files beside which a summary speaks of an adapter: a PEFT save's (safetensors,
#: or the pickle of an unsafe save) and the one other file the sidecar reads as an adapter.
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors")
#: Why the run's summary in a folder without adapter files (its output folder) is unsigned.
NO_ADAPTER_HERE = ("no adapter files in this folder: the run's verdicts only (the sidecar "
                   "signs a summary beside the adapter files it read)")

#: Runs already warned about an unsigned summary.
_WARNED_UNSIGNED: set[str] = set()


def write_beside(folder: Path, adapter: AdapterDigest, run_id: str, step: int, address: str,
                 token: str | None, tls_root: bytes | None, timeout: float) -> Path | None:
    """The run's summary beside the adapter in folder, signed when the sidecar signs it.
    Never raises for a sidecar or disk problem: it is logged and the save goes on."""
    if not adapter.tensors or not folder.is_dir():
        return None  # not an adapter run, or the folder is gone
    holds_adapter = any((folder / name).is_file() for name in ADAPTER_FILES)
    if holds_adapter:
        share_with_group(folder)  # the sidecar reads what it signs, through the group
        body, signature, why = fetch_signed(address, run_id, token, tls_root, adapter, step,
                                            timeout, folder)
    else:  # the run's record in its output folder: the sidecar signs only adapter files
        body, signature, why = None, None, NO_ADAPTER_HERE
    if body is None:
        status, sidecar = fetch_verdicts(address, run_id, token, tls_root, timeout)
        body = unsigned_summary(run_id, step, adapter, status, sidecar).body()
        # Said once per run, only beside an adapter a gate would refuse, and only when the
        # sidecar answers otherwise: an unreachable one has been warned about already, and
        # the unsigned summary says so itself.
        answered = sidecar == "answered" and holds_adapter and run_id not in _WARNED_UNSIGNED
        level = logging.WARNING if answered else logging.DEBUG
        if answered:
            _WARNED_UNSIGNED.add(run_id)
        log.log(level, "deadweight: the summary beside %s is not signed by the sidecar (%s); "
                "a gate that requires signed summaries will refuse this adapter", folder, why)
    try:
        return run_summary.write(folder, body, signature, unsigned_because=why)
    except OSError as err:
        log.warning("deadweight: cannot write the run summary into %s (%s)", folder, err)
        return None


#: model -> (the summary writer, the save_pretrained it replaced on the instance, if any).
#: Kept here, not on the model, so that a copy of the model does not write this run's summary.
_WRITERS: weakref.WeakKeyDictionary[Any, tuple[SummaryOnSave, Any]] = (
    weakref.WeakKeyDictionary())


class _SavingMethod:
    """``save_pretrained`` on one model's instance: the model's own save, then the run summary
    beside what it wrote. It holds the model weakly and survives what happens to models: a
    deep copy gets one bound to the copy (which saves plainly: no writer is registered for
    it), and pickling the model keeps working (no closure, no lookup by name)."""

    def __init__(self, model: Any) -> None:
        self._model = weakref.ref(model)

    def __call__(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        if model is None:
            raise ReferenceError("the model this save_pretrained belonged to is gone")
        writer, original = _WRITERS.get(model, (None, None))
        if original is not None:
            result = original(save_directory, *args, **kwargs)
        else:
            result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
        if writer is not None and kwargs.get("is_main_process", True):
            try:
                # The summary's digest describes the files as this save wrote them.
                writer.write(Path(save_directory), model,
                             kwargs.get("save_embedding_layers", "auto"))
            except Exception:  # the save itself succeeded: never fail it for us
                log.warning("deadweight: writing the run summary into %s failed",
                            save_directory, exc_info=True)
        return result

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _SavingMethod, (self._model(),)

    def __deepcopy__(self, memo: dict[int, Any]) -> _SavingMethod:
        model = self._model()
        return _SavingMethod(memo.get(id(model), model))


class SummaryOnSave:
    """Wraps ``model.save_pretrained`` on the instance: after every save of the adapter (a
    checkpoint, ``trainer.save_model(dir)``, a direct call), ``write(dir, model,
    save_embedding_layers)`` runs, with the save's own ``save_embedding_layers``.

    Installed again on the same model (a second run with a new callback), the writer is
    replaced, not stacked, so a save writes one summary, the newest run's.
    """

    def __init__(self, write: Callable[[Path, Any, EmbeddingLayers], None]) -> None:
        self.write = write

    def install(self, model: Any) -> bool:
        if not callable(getattr(model, "save_pretrained", None)):
            return False
        try:
            previous = _WRITERS.get(model)
            own = vars(model).get("save_pretrained")
            if isinstance(own, _SavingMethod):
                own = None  # ours, on a copy of a model that had it: never chain to ourselves
            # Someone else's override on the instance stays in the chain.
            _WRITERS[model] = (self, previous[1] if previous is not None else own)
            object.__setattr__(model, "save_pretrained", _SavingMethod(model))
        except (AttributeError, TypeError):  # no instance dict, not weak-referenceable
            return False
        return True
