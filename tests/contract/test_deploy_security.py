"""The Kubernetes manifests and the compose stack under attack: the security properties the
design (the security model: a unix socket by default, TCP only with TLS and a token, the peer's
uid from the kernel) and issues 28 and 36 require of ``deploy/kubernetes`` and
``deploy/compose``, read from the YAML.

Each property is a function that lists what breaks it in a Job document. The shipped manifest
(and its kustomize render with the state dir on a claim) must list nothing, and each property is
also shown a copy broken the way an attacker or a careless edit would break it, so that no check
passes because it looks at nothing. The wiring (same socket path on both sides, the uids, the
capability) is checked in ``test_deploy_manifests.py``; this file asks what an attacker in the
trainer's container, on the pod network, or on the node could reach.
"""

from __future__ import annotations

import copy
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from tests.contract.test_deploy_manifests import (
    COMPOSE_ENV,
    compose,
    container,
    effective_ids,
    image_flag,
    interpolate,
    job,
    kustomized,
    mounts,
    pod_spec,
    serve_args,
)

SIDECAR, TRAINER = "deadweight", "trainer"
Doc = dict[str, Any]


def _containers(spec: Doc) -> list[Doc]:
    found: list[Doc] = spec.get("initContainers", []) + spec["containers"]
    return found


def _volumes(spec: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in spec["volumes"]}


def _sidecar_args(doc: Doc) -> Any:
    return serve_args(container(pod_spec(doc), SIDECAR).get("args", []))


def _own(spec: Doc, name: str, key: str) -> Any:
    """A securityContext field of a container, else the pod's."""
    own = container(spec, name).get("securityContext", {})
    return own[key] if key in own else spec.get("securityContext", {}).get(key)


# -- the properties ------------------------------------------------------------------------


def grpc_transport(doc: Doc) -> list[str]:
    """gRPC only on a unix socket in a shared in-memory emptyDir that only the two containers
    mount; TCP (--listen) only with a TLS certificate and key and a bearer token."""
    spec, args = pod_spec(doc), _sidecar_args(doc)
    found = []
    if args.listen is not None and not (args.tls_cert and args.tls_key and args.token_file):
        found.append(f"gRPC on TCP {args.listen} without TLS and a token")
    if args.insecure:
        found.append("--insecure: TCP without TLS")
    socket_dir = str(Path(args.socket).parent)
    names = [n for n, m in mounts(container(spec, SIDECAR)).items()
             if m["mountPath"] == socket_dir]
    if len(names) != 1:
        return [*found, f"the socket folder {socket_dir} is not one mounted volume"]
    empty = _volumes(spec)[names[0]].get("emptyDir")
    if empty is None or empty.get("medium") != "Memory":
        found.append("the socket volume is not an in-memory emptyDir (a sticky tmpfs root)")
    elif not empty.get("sizeLimit"):
        found.append("the socket volume has no sizeLimit")
    users = sorted(c["name"] for c in _containers(spec) if names[0] in mounts(c))
    if users != sorted([SIDECAR, TRAINER]):
        found.append(f"the socket volume is mounted by {users}")
    return found


def reporters(doc: Doc) -> list[str]:
    """Only the trainer's uid may report runs, the sockets belong to the group both share,
    and no stream is accepted unattested."""
    spec, args = pod_spec(doc), _sidecar_args(doc)
    found = []
    if args.trainer_uid != [effective_ids(spec, TRAINER)[0]]:
        found.append(f"--trainer-uid is {args.trainer_uid}, not the trainer's uid")
    if args.socket_group != spec["securityContext"].get("fsGroup"):
        found.append("--socket-group is not the pod's fsGroup")
    if args.allow_unattested:
        found.append("--allow-unattested: any process that reaches the socket may report")
    return found


def network_exposure(doc: Doc) -> list[str]:
    """The sidecar's only TCP port is /metrics (the image's --metrics-address port), none
    on the node (no hostPort, no host network, PID or IPC namespace); its probes read /metrics."""
    spec = pod_spec(doc)
    sidecar = container(spec, SIDECAR)
    found = []
    port = int(image_flag("--metrics-address").rsplit(":", 1)[1])
    ports = sidecar.get("ports", [])
    if [(p.get("name"), p["containerPort"], p.get("protocol", "TCP")) for p in ports] != [
            ("metrics", port, "TCP")]:
        found.append(f"the sidecar's ports are {ports}, not metrics:{port} alone")
    for c in _containers(spec):
        if any("hostPort" in p for p in c.get("ports", [])):
            found.append(f"{c['name']} binds a port on the node (hostPort)")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            found.append(f"{key}: the pod shares the node's namespace")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = sidecar.get(probe, {}).get("httpGet")
        if get is not None and (get.get("path"), get.get("port")) != ("/metrics", "metrics"):
            found.append(f"{probe} reads {get}, not /metrics")
    return found


def least_privilege(doc: Doc) -> list[str]:
    """The sidecar runs as a non-root uid that is not the trainer's, never escalates, is not
    privileged, has a read-only root filesystem, drops every capability but KILL (signals to
    the trainer's uid under a kill policy) and runs under the runtime's seccomp profile; the
    trainer drops every capability and never escalates either."""
    spec = pod_spec(doc)
    found = []
    uid = effective_ids(spec, SIDECAR)[0]
    if uid == 0 or not _own(spec, SIDECAR, "runAsNonRoot"):
        found.append(f"the sidecar may run as root (uid {uid})")
    if uid == effective_ids(spec, TRAINER)[0]:
        found.append("the sidecar runs as the trainer's uid (the trainer could signal it)")
    for name in (SIDECAR, TRAINER):
        if _own(spec, name, "allowPrivilegeEscalation") is not False:
            found.append(f"{name} may escalate privileges")
        if _own(spec, name, "privileged"):
            found.append(f"{name} is privileged")
        if (_own(spec, name, "seccompProfile") or {}).get("type") != "RuntimeDefault":
            found.append(f"{name} runs without the runtime's seccomp profile")
        caps = _own(spec, name, "capabilities") or {}
        allowed = {"KILL"} if name == SIDECAR else set()
        if caps.get("drop") != ["ALL"] or not set(caps.get("add", [])) <= allowed:
            found.append(f"{name}'s capabilities are {caps}, not ALL dropped and "
                         f"{sorted(allowed) or 'none'} added")
    if _own(spec, SIDECAR, "readOnlyRootFilesystem") is not True:
        found.append("the sidecar's root filesystem is writable")
    return found


_UNITS = {"": 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 1e3, "M": 1e6,
          "G": 1e9}


def quantity(text: str | int) -> float:
    """A Kubernetes quantity ("50m", "1", "256Mi") as a number."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert match and match.group(2) in _UNITS, text
    return float(match.group(1)) * _UNITS[match.group(2)]


def bounded_resources(doc: Doc) -> list[str]:
    """The sidecar has CPU and memory limits at or above its requests, and every emptyDir
    (its sockets, journal and temp files) a sizeLimit: whatever a client sends, the sidecar
    cannot take the node's memory, cores or disk from the trainer."""
    spec = pod_spec(doc)
    resources = container(spec, SIDECAR).get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    found = [f"no {kind} limit on the sidecar" for kind in ("cpu", "memory")
             if kind not in limits]
    for kind, asked in requests.items():
        if kind in limits and quantity(asked) > quantity(limits[kind]):
            found.append(f"the sidecar requests more {kind} than its limit")
    for name, volume in _volumes(spec).items():
        if "emptyDir" in volume and name != "output" and not (
                volume["emptyDir"] or {}).get("sizeLimit"):
            found.append(f"emptyDir {name} has no sizeLimit")
    return found


def no_api_credentials(doc: Doc) -> list[str]:
    """No service account token in the pod: neither container talks to the Kubernetes API,
    so a compromised trainer finds no credential to use against the cluster."""
    if pod_spec(doc).get("automountServiceAccountToken") is not False:
        return ["a service account token is mounted into both containers"]
    return []


def private_state(doc: Doc) -> list[str]:
    """The journal and the signing key are the sidecar's alone: the state volume (and its
    temp folder) are mounted in the sidecar only, the state dir is a folder the sidecar makes
    0700 inside the mount, and the volume's ownership is changed only when its root is not the
    fsGroup's (so a kept claim's 0600 key never turns group-readable at the next pod)."""
    spec, args = pod_spec(doc), _sidecar_args(doc)
    found = []
    sidecar = mounts(container(spec, SIDECAR))
    state = [n for n, m in sidecar.items() if Path(args.state_dir).parent == Path(m["mountPath"])]
    if len(state) != 1:
        return [f"--state-dir {args.state_dir} is not a folder inside one mount"]
    private = {state[0], *(n for n, m in sidecar.items() if m["mountPath"] == "/tmp")}
    for c in _containers(spec):
        if c["name"] != SIDECAR and private & set(mounts(c)):
            found.append(f"{c['name']} mounts the sidecar's {sorted(private & set(mounts(c)))}")
    context = spec["securityContext"]
    if "fsGroup" in context and context.get("fsGroupChangePolicy") != "OnRootMismatch":
        found.append("fsGroupChangePolicy is not OnRootMismatch: every new pod re-chmods a "
                     "kept state volume group-readable")
    return found


PROPERTIES: dict[str, Callable[[Doc], list[str]]] = {
    "grpc_transport": grpc_transport,
    "reporters": reporters,
    "network_exposure": network_exposure,
    "least_privilege": least_privilege,
    "bounded_resources": bounded_resources,
    "no_api_credentials": no_api_credentials,
    "private_state": private_state,
}


# -- the shipped manifest holds every property ----------------------------------------------


@pytest.mark.parametrize("name", PROPERTIES)
def test_the_shipped_job_holds(name: str) -> None:
    assert PROPERTIES[name](job()) == []


def _rendered_jobs(tmp_path: Path) -> list[Doc]:
    """The Job as kustomize renders it, with the keep-reports option (a claim for the state
    dir) on: the option must not give up a property."""
    docs = kustomized(tmp_path, keep_reports=True)
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert len(claims) == 1 and set(claims[0]["spec"]["accessModes"]) <= {
        "ReadWriteOnce", "ReadWriteOncePod"}  # one node's pod at a time, never shared
    jobs = [d for d in docs if d["kind"] == "Job"]
    [state] = [v for v in pod_spec(jobs[0])["volumes"] if v["name"] == "deadweight-state"]
    assert state["persistentVolumeClaim"]["claimName"] == claims[0]["metadata"]["name"]
    return jobs


def test_the_keep_reports_render_holds_every_property(tmp_path: Path) -> None:
    [rendered] = _rendered_jobs(tmp_path)
    assert {name: check(rendered) for name, check in PROPERTIES.items()} == {
        name: [] for name in PROPERTIES}


# -- and each property catches the break it names -------------------------------------------


def _args(doc: Doc) -> list[str]:
    found: list[str] = container(pod_spec(doc), SIDECAR)["args"]
    return found


def _sc(doc: Doc, name: str = SIDECAR) -> Doc:
    found: Doc = container(pod_spec(doc), name)["securityContext"]
    return found


def _drop_flag(doc: Doc, flag: str) -> None:
    args = _args(doc)
    at = args.index(flag)
    del args[at:at + 2]


BREAKS: list[tuple[str, str, Callable[[Doc], object]]] = [
    ("grpc_transport", "without TLS and a token",
     lambda d: _args(d).extend(["--listen", "0.0.0.0:50051"])),
    ("grpc_transport", "in-memory emptyDir",
     lambda d: _volumes(pod_spec(d))["deadweight-socket"]["emptyDir"].pop("medium")),
    ("grpc_transport", "mounted by",
     lambda d: container(pod_spec(d), TRAINER)["volumeMounts"].remove(
         mounts(container(pod_spec(d), TRAINER))["deadweight-socket"])),
    ("reporters", "--trainer-uid", lambda d: _drop_flag(d, "--trainer-uid")),
    ("reporters", "--allow-unattested", lambda d: _args(d).append("--allow-unattested")),
    ("network_exposure", "not metrics",
     lambda d: container(pod_spec(d), SIDECAR)["ports"].append(
         {"name": "grpc", "containerPort": 50051})),
    ("network_exposure", "hostPort",
     lambda d: container(pod_spec(d), SIDECAR)["ports"][0].update(hostPort=9464)),
    ("network_exposure", "hostNetwork", lambda d: pod_spec(d).update(hostNetwork=True)),
    ("least_privilege", "as root", lambda d: _sc(d).update(runAsUser=0)),
    ("least_privilege", "escalate", lambda d: _sc(d).update(allowPrivilegeEscalation=True)),
    ("least_privilege", "privileged", lambda d: _sc(d).update(privileged=True)),
    ("least_privilege", "root filesystem is writable",
     lambda d: _sc(d).update(readOnlyRootFilesystem=False)),
    ("least_privilege", "capabilities",
     lambda d: _sc(d)["capabilities"]["add"].append("SYS_PTRACE")),
    ("least_privilege", "trainer's uid",
     lambda d: _sc(d).update(runAsUser=_sc(d, TRAINER)["runAsUser"])),
    ("least_privilege", "seccomp",
     lambda d: pod_spec(d)["securityContext"].pop("seccompProfile")),
    ("bounded_resources", "no cpu limit",
     lambda d: container(pod_spec(d), SIDECAR)["resources"]["limits"].pop("cpu")),
    ("bounded_resources", "more memory",
     lambda d: container(pod_spec(d), SIDECAR)["resources"]["requests"].update(memory="2Gi")),
    ("bounded_resources", "sizeLimit",
     lambda d: _volumes(pod_spec(d))["deadweight-state"]["emptyDir"].pop("sizeLimit")),
    ("no_api_credentials", "token",
     lambda d: pod_spec(d).pop("automountServiceAccountToken")),
    ("private_state", "mounts the sidecar's",
     lambda d: container(pod_spec(d), TRAINER)["volumeMounts"].append(
         {"name": "deadweight-state", "mountPath": "/var/lib/deadweight"})),
    ("private_state", "OnRootMismatch",
     lambda d: pod_spec(d)["securityContext"].pop("fsGroupChangePolicy")),
]


@pytest.mark.parametrize(("name", "said", "breaking"), BREAKS,
                         ids=[f"{n}-{s}" for n, s, _ in BREAKS])
def test_each_property_catches_its_break(name: str, said: str,
                                         breaking: Callable[[Doc], object]) -> None:
    broken = copy.deepcopy(job())
    breaking(broken)
    found = PROPERTIES[name](broken)
    assert any(said in line for line in found), found


def test_tcp_with_tls_and_a_token_is_allowed() -> None:
    """The design's other transport: TCP, with TLS and a bearer token, passes."""
    doc = copy.deepcopy(job())
    _args(doc).extend(["--listen", "0.0.0.0:50051", "--tls-cert", "/tls/tls.crt",
                       "--tls-key", "/tls/tls.key", "--token-file", "/tls/token"])
    assert grpc_transport(doc) == []


def test_a_kept_state_dir_recursively_regrouped_stops_the_sidecar(tmp_path: Path) -> None:
    """Why fsGroupChangePolicy must be OnRootMismatch: what the kubelet's default (Always)
    does to a kept claim at each new pod (every file and folder gets the fsGroup's read-write
    bits, folders setgid), done to a real state dir, makes the next sidecar refuse to start
    on its group-readable signing key. Untouched, the same state dir starts again."""
    state = tmp_path / "volume" / "state"
    args = ["--state-dir", str(state)]
    with SidecarProcess(tmp_path / "one", extra_args=args):
        pass
    with SidecarProcess(tmp_path / "two", extra_args=args):  # control: kept as it was
        pass
    for folder, _, files in os.walk(tmp_path / "volume"):
        base = Path(folder)
        os.chmod(base, stat.S_IMODE(base.stat().st_mode) | 0o2070)
        for name in files:
            path = base / name
            os.chmod(path, stat.S_IMODE(path.stat().st_mode) | 0o060)
    refused = SidecarProcess(tmp_path / "three", extra_args=args)
    with pytest.raises(RuntimeError, match="group or others may read the signing key"):
        refused.start()


# -- the compose stack: the sidecar is not the trainer -------------------------------------
#
# On one machine the trainer runs on the host as the user who started the stack
# (DEADWEIGHT_TRAINER_UID / _GID, see the stack's header). The sidecar must run as another
# uid, keep its state (the journal and the summary signing key) where that uid cannot read it,
# admit only the trainer's uid as a reporter over sockets it hands to the trainer's group, and
# hold KILL alone, to signal the trainer's uid under a kill policy.


def _compose_sidecar(doc: Doc) -> Doc:
    found: Doc = doc["services"][SIDECAR]
    return found


def _compose_args(doc: Doc) -> Any:
    return serve_args([interpolate(a) for a in _compose_sidecar(doc)["command"]])


def _trainer_ids() -> tuple[int, int]:
    return (int(COMPOSE_ENV["DEADWEIGHT_TRAINER_UID"]),
            int(COMPOSE_ENV["DEADWEIGHT_TRAINER_GID"]))


def compose_own_uid(doc: Doc) -> list[str]:
    """The sidecar's user is a fixed, non-root uid that is not the trainer's (whatever the
    trainer's ids are set to): a job cannot read its key, signal it, or claim its on-call
    powers."""
    user = str(_compose_sidecar(doc).get("user", ""))
    found = []
    if "$" in user:
        found.append(f"the sidecar's user {user!r} follows a variable, as the trainer's would")
    uid = interpolate(user).split(":")[0]
    if not uid.isdigit() or int(uid) == 0:
        found.append(f"the sidecar may run as root (user {user!r})")
    elif int(uid) == _trainer_ids()[0]:
        found.append("the sidecar runs as the trainer's uid")
    return found


def compose_private_state(doc: Doc) -> list[str]:
    """--state-dir is a folder inside a named volume: no host folder the trainer could read
    the journal or the signing key from (a bind mount keeps the host folder's owner and
    mode, and a later chmod on the host opens it)."""
    args = _compose_args(doc)
    for entry in _compose_sidecar(doc).get("volumes", []):
        source, target = interpolate(entry).split(":")[:2]
        if Path(args.state_dir).is_relative_to(target):
            if source.startswith((".", "/", "~")):
                return [f"the state dir {args.state_dir} is on a bind mount of the host's "
                        f"{source}"]
            if source not in doc.get("volumes", {}):
                return [f"the state volume {source} is not declared"]
            if Path(args.state_dir) == Path(target):
                return ["the state dir is the volume's root, not a folder the sidecar makes"]
            return []
    return [f"the state dir {args.state_dir} is not on a volume: it goes with the container"]


def compose_reporters(doc: Doc) -> list[str]:
    """Only the trainer's uid reports; the 0660 sockets go to the trainer's group, which the
    sidecar is a member of (a process may hand a file only to a group it is in); no stream is
    accepted unattested."""
    args, sidecar = _compose_args(doc), _compose_sidecar(doc)
    uid, gid = _trainer_ids()
    found = []
    if args.trainer_uid != [uid]:
        found.append(f"--trainer-uid is {args.trainer_uid}, not the trainer's uid")
    if args.socket_group != gid:
        found.append(f"--socket-group is {args.socket_group}, not the trainer's group")
    if str(gid) not in [interpolate(str(g)) for g in sidecar.get("group_add", [])]:
        found.append("the sidecar is not in the trainer's group (group_add)")
    if args.allow_unattested:
        found.append("--allow-unattested: any process that reaches the socket may report")
    return found


def compose_signals(doc: Doc) -> list[str]:
    """KILL is the one capability kept (every other dropped), with the host's PIDs, so a
    stop or kill policy can signal the trainer of another uid and nothing more."""
    sidecar = _compose_sidecar(doc)
    found = []
    if sidecar.get("cap_drop") != ["ALL"] or sidecar.get("cap_add") != ["KILL"]:
        found.append(f"the sidecar's capabilities are drop {sidecar.get('cap_drop')}, add "
                     f"{sidecar.get('cap_add')}, not ALL dropped and KILL added")
    if sidecar.get("privileged"):
        found.append("the sidecar is privileged")
    if sidecar.get("pid") != "host":
        found.append("the sidecar does not see the host's PIDs: no trainer can be signalled")
    return found


COMPOSE_PROPERTIES: dict[str, Callable[[Doc], list[str]]] = {
    "compose_own_uid": compose_own_uid,
    "compose_private_state": compose_private_state,
    "compose_reporters": compose_reporters,
    "compose_signals": compose_signals,
}


@pytest.mark.parametrize("name", COMPOSE_PROPERTIES)
def test_the_shipped_compose_stack_holds(name: str) -> None:
    assert COMPOSE_PROPERTIES[name](compose()) == []


def _command(doc: Doc) -> list[str]:
    found: list[str] = _compose_sidecar(doc)["command"]
    return found


def _drop_compose_flag(doc: Doc, flag: str) -> None:
    command = _command(doc)
    at = command.index(flag)
    del command[at:at + 2]


def _state_on(doc: Doc, source: str) -> None:
    volumes = _compose_sidecar(doc)["volumes"]
    [at] = [i for i, v in enumerate(volumes) if v.endswith(":/var/lib/deadweight")]
    volumes[at] = f"{source}:/var/lib/deadweight"


COMPOSE_BREAKS: list[tuple[str, str, Callable[[Doc], object]]] = [
    # The stack as it was: the sidecar as the trainer's uid, its state in a host folder.
    ("compose_own_uid", "follows a variable",
     lambda d: _compose_sidecar(d).update(
         user="${DEADWEIGHT_TRAINER_UID:-10001}:${DEADWEIGHT_TRAINER_GID:-10001}")),
    ("compose_own_uid", "the trainer's uid",
     lambda d: _compose_sidecar(d).update(user="1000:1000")),
    ("compose_own_uid", "as root", lambda d: _compose_sidecar(d).update(user="0:0")),
    ("compose_private_state", "bind mount", lambda d: _state_on(d, "./state")),
    ("compose_private_state", "not declared", lambda d: _state_on(d, "elsewhere")),
    ("compose_private_state", "volume's root",
     lambda d: _command(d).extend(["--state-dir", "/var/lib/deadweight"])),
    ("compose_reporters", "--trainer-uid", lambda d: _drop_compose_flag(d, "--trainer-uid")),
    ("compose_reporters", "--socket-group", lambda d: _drop_compose_flag(d, "--socket-group")),
    ("compose_reporters", "group_add", lambda d: _compose_sidecar(d).pop("group_add")),
    ("compose_reporters", "--allow-unattested",
     lambda d: _command(d).append("--allow-unattested")),
    ("compose_signals", "KILL added", lambda d: _compose_sidecar(d).pop("cap_add")),
    ("compose_signals", "KILL added",
     lambda d: _compose_sidecar(d)["cap_add"].append("SYS_PTRACE")),
    ("compose_signals", "ALL dropped", lambda d: _compose_sidecar(d).pop("cap_drop")),
    ("compose_signals", "host's PIDs", lambda d: _compose_sidecar(d).pop("pid")),
]


@pytest.mark.parametrize(("name", "said", "breaking"), COMPOSE_BREAKS,
                         ids=[f"{n}-{s}" for n, s, _ in COMPOSE_BREAKS])
def test_each_compose_property_catches_its_break(name: str, said: str,
                                                 breaking: Callable[[Doc], object]) -> None:
    broken = copy.deepcopy(compose())
    breaking(broken)
    found = COMPOSE_PROPERTIES[name](broken)
    assert any(said in line for line in found), found
