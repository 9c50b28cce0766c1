"""The run summary written next to every saved adapter: what a promotion gate checks.

The sidecar composes the summary from its own state (verdicts, actions, end reason) with the
adapter digest the run's process sent, and signs it (``SignSummary``); the callback writes it
as ``deadweight-summary.json`` beside each adapter the run saves. ``deadweight inspect``
reads it beside the adapter it audits (or up the folders), checks the signature against a
trusted public key, checks that the adapter's bytes are the ones the run produced, and fails
on a critical verdict or a stopped run. Both sides share this one schema, so it lives with
the wire format.

File layout (schema 2)::

    {"schema": 2, "summary": {...}, "signature": {"algorithm": "ed25519",
     "key_id": "...", "value": "<base64>"} | null}

The signature covers ``canonical(summary)``: UTF-8 JSON, keys sorted, no spaces. A summary
the sidecar could not sign (no sidecar, an old sidecar) is written with ``signature: null``
and ``sidecar`` saying why. Schema 1 files (unsigned, no verdict states) are still read.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FILE_NAME = "deadweight-summary.json"
SCHEMA = 2
ALGORITHM = "ed25519"

#: Verdict states a person reads (``SummaryVerdict.state``).
FIRING = "firing"
FIRING_AT_END = "firing at end"
RESOLVED = "resolved"

#: Actions that stopped a run, with the results that mean they were carried out.
_STOPPING = {"stop": ("sent", "requeued"), "sigterm": ("sent",), "sigkill": ("sent",)}


@dataclass(frozen=True)
class SummaryVerdict:
    detector: str
    severity: str
    firing: bool
    step: int
    summary: str
    #: firing (the run is live), firing at end (it still fired when the run ended),
    #: resolved (it cleared while the run was live).
    state: str = ""
    policy: str = ""

    def stands(self) -> bool:
        """True unless the condition cleared while the run was live."""
        return self.state != RESOLVED if self.state else self.firing


@dataclass(frozen=True)
class RunSummary:
    """The facts a gate needs: the adapter's digests and what the sidecar concluded."""

    run_id: str
    step: int
    #: tensor name -> xxh3-128 of its bytes (the same digest the sidecar's inspector takes).
    adapter_tensors: dict[str, str]
    adapter_digest: str
    #: "answered" when the verdicts below came from the sidecar, else why they are missing.
    sidecar: str
    end_reason: str = ""
    verdicts: list[SummaryVerdict] = field(default_factory=list)
    actions: list[dict[str, str]] = field(default_factory=list)
    #: Whether the run had ended when the summary was made (a checkpoint's is taken live).
    ended: bool = False
    #: The run's output folder (RunStart.output_dir): where a gate may look for the summary.
    output_dir: str = ""
    #: Unix seconds when the sidecar composed it (0: not the sidecar's).
    signed_at: int = 0
    #: The baseline the run was judged against ("" when it named none).
    baseline: str = ""

    def critical(self) -> list[SummaryVerdict]:
        """Critical verdicts that fired during the run (resolved ones included: a run that
        stopped learning for a while still produced a suspect adapter)."""
        return [v for v in self.verdicts if v.severity == "critical"]

    def stopped(self) -> bool:
        """The sidecar stopped or signalled the run, or the run ended as stopped."""
        if self.end_reason in ("stopped", "killed"):
            return True
        return any(a.get("result") in _STOPPING.get(a.get("action", ""), ())
                   for a in self.actions)

    def body(self) -> dict[str, Any]:
        return asdict(self)


def canonical(body: dict[str, Any]) -> bytes:
    """The exact bytes the signature covers."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True)
class Signature:
    key_id: str
    value: bytes
    algorithm: str = ALGORITHM


@dataclass(frozen=True)
class SummaryFile:
    """A summary as read from disk: its body, the body's bytes as signed, its signature."""

    summary: RunSummary
    signed_bytes: bytes
    signature: Signature | None
    schema: int
    #: Why the writer has no signature (outside the signed body: a hint, not evidence).
    unsigned_because: str = ""


def write(folder: Path, body: dict[str, Any], signature: Signature | None,
          unsigned_because: str = "") -> Path:
    """Write the summary beside an adapter; a reader never sees half a file."""
    path = folder / FILE_NAME
    document: dict[str, Any] = {
        "schema": SCHEMA, "summary": body,
        "signature": None if signature is None else {
            "algorithm": signature.algorithm, "key_id": signature.key_id,
            "value": base64.b64encode(signature.value).decode("ascii")},
    }
    if signature is None and unsigned_because:
        document["unsigned_because"] = unsigned_because
    tmp = path.with_name(f"{FILE_NAME}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    tmp.replace(path)
    return path


class BadSummary(ValueError):
    """A summary file that cannot be read or has the wrong shape."""


def _verdict(raw: dict[str, Any]) -> SummaryVerdict:
    return SummaryVerdict(
        detector=str(raw["detector"]), severity=str(raw["severity"]),
        firing=bool(raw["firing"]), step=int(raw["step"]), summary=str(raw["summary"]),
        state=str(raw.get("state", "")), policy=str(raw.get("policy", "")))


def from_body(body: Any) -> RunSummary:
    """A RunSummary from its JSON object (raises KeyError, TypeError, ValueError)."""
    if not isinstance(body, dict):
        raise TypeError("the summary is not a JSON object")
    return RunSummary(
        run_id=str(body["run_id"]), step=int(body["step"]),
        adapter_tensors={str(k): str(v) for k, v in body["adapter_tensors"].items()},
        adapter_digest=str(body["adapter_digest"]), sidecar=str(body["sidecar"]),
        end_reason=str(body.get("end_reason", "")),
        verdicts=[_verdict(v) for v in body.get("verdicts", [])],
        actions=[{str(k): str(v) for k, v in a.items()} for a in body.get("actions", [])],
        ended=bool(body.get("ended", False)), output_dir=str(body.get("output_dir", "")),
        signed_at=int(body.get("signed_at", 0)), baseline=str(body.get("baseline", "")),
    )


def _signature(raw: Any) -> Signature | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TypeError("signature is not an object")
    try:
        value = base64.b64decode(str(raw["value"]), validate=True)
    except binascii.Error as err:
        raise ValueError(f"signature is not base64 ({err})") from err
    return Signature(key_id=str(raw["key_id"]), value=value,
                     algorithm=str(raw.get("algorithm", "")))


def read(path: Path) -> SummaryFile:
    try:
        document: Any = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(document, dict) or document.get("schema") not in (1, SCHEMA):
            raise BadSummary(f"{path}: not a deadweight summary (schema 1 or {SCHEMA})")
        if document["schema"] == 1:  # unsigned, the body at the top level
            body = {k: v for k, v in document.items() if k != "schema"}
            return SummaryFile(from_body(body), canonical(body), None, 1)
        body = document["summary"]
        return SummaryFile(from_body(body), canonical(body), _signature(document["signature"]),
                           SCHEMA, str(document.get("unsigned_because", ""))[:500])
    except BadSummary:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise BadSummary(f"{path}: unreadable deadweight summary ({err})") from err
