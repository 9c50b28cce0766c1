"""Offline checks of the Kubernetes manifests and the compose stack in deploy/.

Schemas: the Kubernetes ones shipped by kubernetes-validate (strict: unknown fields fail), the
Prometheus Operator CRD models for PodMonitor and PrometheusRule (generated from the CRDs'
OpenAPI schemas, checked for a lossless round trip so unknown fields fail too), and the Compose
Specification schema shipped by check-jsonschema. Each validator is also shown a broken copy,
so a test cannot pass because the validator accepts anything. The wiring the schemas cannot see
(same socket path on both sides, the two UIDs and the one capability, ports,
labels, mounts) is checked across files, and
the Prometheus and Alertmanager configs go through the real promtool and amtool.
"""

from __future__ import annotations

import argparse
import copy
import importlib.resources
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from deadweight.sidecar.commands.cli import build_parser
from deploy.kubernetes import prometheusrule

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE = COMPOSE_DIR / "compose.yaml"
# Native sidecars (restartPolicy on an init container) are on by default from 1.29.
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def job() -> dict[str, Any]:
    doc: dict[str, Any] = load(KUBE / "training-job.yaml")
    return doc


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"one container named {name}"
    one: dict[str, Any] = found[0]
    return one


def mounts(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in c["volumeMounts"]}


def dockerfile_instruction(keyword: str) -> str:
    """The argument of a Dockerfile instruction, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    found = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(keyword + " ")]
    assert len(found) == 1, f"one {keyword} in the Dockerfile"
    return found[0]


def image_flag(flag: str) -> str:
    entrypoint: list[str] = json.loads(dockerfile_instruction("ENTRYPOINT"))
    return entrypoint[entrypoint.index(flag) + 1]


def image_state_dir() -> str:
    """The sidecar's state dir in the image: --state-dir when given, else its WORKDIR."""
    if "--state-dir" in json.loads(dockerfile_instruction("ENTRYPOINT")):
        return image_flag("--state-dir")
    workdirs = [line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines()
                if line.startswith("WORKDIR ")]
    return workdirs[-1]


def serve_args(extra: list[str]) -> argparse.Namespace:
    """The image's ENTRYPOINT plus `extra`, parsed by the real CLI (a bad flag exits)."""
    entrypoint: list[str] = json.loads(dockerfile_instruction("ENTRYPOINT"))
    assert entrypoint[0] == "deadweight"
    return build_parser().parse_args([*entrypoint[1:], *extra])


# --- Kubernetes ---------------------------------------------------------------------------


def test_job_sidecar_args_are_accepted_by_the_cli() -> None:
    spec = pod_spec(job())
    sidecar = container(spec, "deadweight")
    args = serve_args(sidecar.get("args", []))
    assert args.alertmanager_url.startswith("http://")
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    # A folder inside the state volume: the volume's own root belongs to root, and the
    # sidecar refuses a state dir it does not own.
    assert Path(args.state_dir).parent == Path(mounts["deadweight-state"])
    assert mounts["deadweight-state"] == image_state_dir()
    # Checkpoints are read only under the output mount the trainer writes to.
    assert args.watch_root == [mounts["output"]]
    # Only the trainer's uid may report runs; the sockets go to the group both share.
    assert args.trainer_uid == [effective_ids(spec, "trainer")[0]]
    assert args.socket_group == spec["securityContext"]["fsGroup"]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_job_validates_against_kubernetes_schema(version: str) -> None:
    kubernetes_validate.validate(job(), version, strict=True)


def test_kubernetes_validator_rejects_unknown_and_too_new_fields() -> None:
    broken = job()
    pod_spec(broken)["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicyy"):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[0], strict=True)
    # Before native sidecars existed the field is unknown: the schema really is versioned.
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(job(), "1.27.0", strict=True)


def test_job_runs_deadweight_as_native_sidecar_beside_the_trainer() -> None:
    spec = pod_spec(job())
    assert [c["name"] for c in spec["initContainers"]] == ["deadweight"]
    assert [c["name"] for c in spec["containers"]] == ["trainer"]
    sidecar = container(spec, "deadweight")
    assert sidecar["restartPolicy"] == "Always"
    assert spec["shareProcessNamespace"] is True
    # Probes gate the trainer's start on the sidecar serving.
    assert sidecar["startupProbe"]["httpGet"]["port"] == "metrics"


def test_job_socket_is_shared_and_matches_the_image_default() -> None:
    spec = pod_spec(job())
    sidecar, trainer = container(spec, "deadweight"), container(spec, "trainer")
    volumes = {v["name"]: v for v in spec["volumes"]}
    socket_path = image_flag("--socket")
    socket_dir = str(Path(socket_path).parent)
    shared = [n for n, m in mounts(sidecar).items() if m["mountPath"] == socket_dir]
    assert len(shared) == 1
    assert "emptyDir" in volumes[shared[0]]
    assert mounts(trainer)[shared[0]]["mountPath"] == socket_dir
    env = {e["name"]: e for e in trainer["env"]}
    assert env["DEADWEIGHT_ADDRESS"]["value"] == f"unix://{socket_path}"
    assert "DEADWEIGHT_RUN_ID" in env


def test_job_output_dir_is_read_only_for_the_sidecar_at_the_trainers_path() -> None:
    spec = pod_spec(job())
    sidecar, trainer = container(spec, "deadweight"), container(spec, "trainer")
    out_side, out_train = mounts(sidecar)["output"], mounts(trainer)["output"]
    assert out_side["readOnly"] is True
    assert not out_train.get("readOnly", False)
    assert out_side["mountPath"] == out_train["mountPath"]
    assert any(arg.startswith(out_train["mountPath"] + "/") for arg in trainer["command"])


def effective_ids(spec: dict[str, Any], name: str) -> tuple[int, int]:
    """(uid, gid) a container runs as: its own securityContext over the pod's."""
    pod_sc, own = spec["securityContext"], container(spec, name).get("securityContext", {})
    return (int(own.get("runAsUser", pod_sc["runAsUser"])),
            int(own.get("runAsGroup", pod_sc["runAsGroup"])))


def test_job_sidecar_runs_as_another_uid_and_may_only_signal() -> None:
    spec = pod_spec(job())
    sidecar, trainer = effective_ids(spec, "deadweight"), effective_ids(spec, "trainer")
    # The trainer can neither signal nor rewrite the sidecar, nor read its journal.
    assert sidecar[0] != trainer[0]
    assert 0 not in (sidecar[0], trainer[0], sidecar[1], trainer[1])
    assert spec["securityContext"]["runAsNonRoot"] is True
    # The sidecar reaches the trainer's uid through CAP_KILL alone.
    caps = container(spec, "deadweight")["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"]
    assert caps["add"] == ["KILL"]
    trainer_caps = container(spec, "trainer")["securityContext"]["capabilities"]
    assert trainer_caps["drop"] == ["ALL"] and "add" not in trainer_caps
    for name in ("deadweight", "trainer"):
        assert container(spec, name)["securityContext"]["allowPrivilegeEscalation"] is False
    # Both are in fsGroup, the group the sidecar hands its 0660 sockets to.
    assert isinstance(spec["securityContext"]["fsGroup"], int)
    # The image's own user is the trainer's uid: a plain `docker run` shares one uid.
    uid, gid = dockerfile_instruction("USER").split(":")
    assert (int(uid), int(gid)) == trainer


def test_image_interpreter_carries_kill_as_a_permitted_file_capability() -> None:
    """The image build grants the venv's interpreter cap_kill (see signal_capability)."""
    runs = [line for line in (ROOT / "Dockerfile").read_text().splitlines()
            if line.startswith("RUN ") and "signal_capability" in line]
    entrypoint = json.loads(dockerfile_instruction("ENTRYPOINT"))[0]
    assert runs == ["RUN /opt/deadweight/bin/python -m "
                    "deadweight.sidecar.actions.signal_capability "
                    f"/opt/deadweight/bin/{entrypoint}"]


def test_podmonitor_selects_the_job_pods_metrics_port() -> None:
    spec = pod_spec(job())
    sidecar = container(spec, "deadweight")
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    monitor = load(KUBE / "podmonitor.yaml")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] in ports
    assert str(ports[endpoint["port"]]) == dockerfile_instruction("EXPOSE")
    assert image_flag("--metrics-address").endswith(f":{ports[endpoint['port']]}")
    labels = job()["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_podmonitor_job_label_matches_the_alerts_job_selector() -> None:
    from alerts.rules import DEFAULT_JOB_SELECTOR

    pattern = re.fullmatch(r'job=~"(.*)"', DEFAULT_JOB_SELECTOR)
    assert pattern, DEFAULT_JOB_SELECTOR
    name = load(KUBE / "podmonitor.yaml")["metadata"]["name"]
    # The operator names the scrape job <namespace>/<PodMonitor name>.
    assert re.fullmatch(pattern.group(1), f"ml-training/{name}")


@pytest.fixture(scope="module")
def operator_models() -> Any:
    from cloudcoil.models.prometheus_operator import v1

    return v1


def round_trip(model: Any, doc: dict[str, Any]) -> dict[str, Any]:
    dumped: dict[str, Any] = model.model_validate(doc).model_dump(
        by_alias=True, exclude_none=True, mode="json")
    return dumped


@pytest.mark.parametrize(("filename", "kind"), [
    ("podmonitor.yaml", "PodMonitor"), ("prometheusrule.yaml", "PrometheusRule")])
def test_operator_resources_validate_against_crd_models(
        operator_models: Any, filename: str, kind: str) -> None:
    doc = load(KUBE / filename)
    assert doc["kind"] == kind
    assert round_trip(getattr(operator_models, kind), doc) == doc


def test_crd_models_reject_bad_values_and_unknown_fields(operator_models: Any) -> None:
    doc = load(KUBE / "podmonitor.yaml")
    bad_interval = copy.deepcopy(doc)
    bad_interval["spec"]["podMetricsEndpoints"][0]["interval"] = "fifteen seconds"
    with pytest.raises(ValueError, match="interval"):
        operator_models.PodMonitor.model_validate(bad_interval)
    unknown = copy.deepcopy(doc)
    unknown["spec"]["podMetricsEndpoints"][0]["portName"] = "metrics"
    assert round_trip(operator_models.PodMonitor, unknown) != unknown


def test_prometheusrule_is_generated_from_alerts() -> None:
    from alerts import generate

    assert generate.PROMETHEUS_RULE not in generate.stale(), f"run {generate.COMMAND}"
    from alerts import rules as alert_rules
    from deploy.kubernetes import links

    # The same rules as alerts/, with the cluster's links (links.env, the one place).
    rules = alert_rules.rules(alert_rules.DEFAULT_JOB_SELECTOR,
                              alert_rules.DEFAULT_STALE_SECONDS, links.patterns())
    shipped = load(KUBE / "prometheusrule.yaml")["spec"]["groups"]
    assert shipped == prometheusrule.per_job_sidecar(rules["groups"])
    down = [r for g in shipped for r in g["rules"] if r.get("alert") == "DeadweightSidecarDown"]
    assert len(down) == 1 and "absent(" not in down[0]["expr"]  # no Job running is no page
    assert "== 0" in down[0]["expr"]
    others = [r for g in shipped for r in g["rules"] if r.get("alert") != "DeadweightSidecarDown"]
    originals = [r for g in rules["groups"] for r in g["rules"]
                 if r.get("alert") != "DeadweightSidecarDown"]
    assert others == originals


def _expanded_sidecar_args() -> list[str]:
    """The sidecar's args as the kubelet passes them: $(NAME) from its env, which reads the
    ConfigMap that kustomization.yaml generates from links.env."""
    from deploy.kubernetes import links

    values = links.read()
    sidecar = container(pod_spec(job()), "deadweight")
    env = {}
    for var in sidecar["env"]:
        ref = var["valueFrom"]["configMapKeyRef"]
        assert ref["name"] == links.CONFIG_MAP
        env[var["name"]] = values[ref["key"]]
    out = []
    for arg in sidecar["args"]:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        assert "$(" not in arg, f"{arg}: not defined in the sidecar's env"
        out.append(arg)
    return out


def test_kubernetes_links_come_from_one_place() -> None:
    """links.env feeds the sidecar (ConfigMap -> env -> args) and the PrometheusRule: both
    send the same runbook and dashboard links; SidecarDown links to the docs pattern."""
    from deploy.kubernetes import links

    patterns = links.patterns()
    args = serve_args(_expanded_sidecar_args())
    assert args.runbook_url_pattern == patterns.runbook
    assert args.dashboard_url_pattern == patterns.dashboard
    for pattern in (patterns.runbook, patterns.dashboard, patterns.docs):
        assert "127.0.0.1" not in str(pattern) and "localhost" not in str(pattern)
    notes = {r["alert"]: r["annotations"] for g in load(KUBE / "prometheusrule.yaml")["spec"][
        "groups"] for r in g["rules"]}
    assert notes["DeadweightFrozenWeights"]["runbook_url"] == patterns.runbook.format(
        detector="frozen_weights", alertname="DeadweightFrozenWeights")
    if patterns.dashboard:
        assert notes["DeadweightFrozenWeights"]["dashboard_url"].startswith(
            patterns.dashboard.split("{run_id}")[0])
    else:  # no dashboard in links.env: no dashboard link on either path
        assert "dashboard_url" not in notes["DeadweightFrozenWeights"]
    assert notes["DeadweightSidecarDown"]["runbook_url"] == str(patterns.docs).format(
        detector="sidecar_down", alertname="DeadweightSidecarDown")
    # The ConfigMap kustomize makes holds exactly links.env's values, under the name used.
    kubectl = require_binary("kubectl")
    docs = list(yaml.safe_load_all(run([kubectl, "kustomize", str(KUBE)])))
    [config_map] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config_map["metadata"]["name"] == links.CONFIG_MAP
    assert config_map["data"] == links.read()


@pytest.mark.parametrize("keep_reports", [False, True])
def test_kustomization_renders_valid_resources(tmp_path: Path, keep_reports: bool) -> None:
    """`kubectl kustomize` of deploy/kubernetes (and with the keep-reports option on, the
    state dir on a PersistentVolumeClaim) gives resources that pass the strict schema."""
    docs = kustomized(tmp_path, keep_reports)
    kinds = sorted(d["kind"] for d in docs)
    expected = ["ConfigMap", "Job", "PodMonitor", "PrometheusRule"]
    assert kinds == sorted(expected + (["PersistentVolumeClaim"] if keep_reports else []))
    [rendered] = [d for d in docs if d["kind"] == "Job"]
    for doc in docs:
        if doc["kind"] in ("ConfigMap", "Job", "PersistentVolumeClaim"):
            kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
    [state] = [v for v in pod_spec(rendered)["volumes"] if v["name"] == "deadweight-state"]
    if keep_reports:
        [claim] = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
        assert state == {"name": "deadweight-state",
                         "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
    else:
        assert "emptyDir" in state


def test_prometheusrule_groups_pass_promtool(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    groups = load(KUBE / "prometheusrule.yaml")["spec"]
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(groups))
    out = run([promtool, "check", "rules", str(rules_file)])
    assert re.search(r"SUCCESS: [1-9]\d* rules found", out), out


# --- compose stack --------------------------------------------------------------------------


def kustomized(tmp_path: Path, keep_reports: bool) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of a copy of deploy/kubernetes, with the keep-reports option (the
    state dir on a PersistentVolumeClaim) turned on as its README says, or not."""
    kubectl = require_binary("kubectl")
    folder = tmp_path / "kube"
    shutil.copytree(KUBE, folder, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    if keep_reports:
        text = (folder / "kustomization.yaml").read_text()
        text = text.replace("  # - state-pvc.yaml", "  - state-pvc.yaml")
        text = text.replace("# patches:\n#   - path: keep-state.patch.yaml",
                            "patches:\n  - path: keep-state.patch.yaml")
        (folder / "kustomization.yaml").write_text(text)
    return list(yaml.safe_load_all(run([kubectl, "kustomize", str(folder)])))


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (.ci/run installs it)")
    return path


def run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = load(COMPOSE)
    return doc


def compose_validator() -> jsonschema.protocols.Validator:
    text = (importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
            / "compose-spec.json").read_text()
    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator: jsonschema.protocols.Validator = cls(schema)
    return validator


def test_compose_file_validates_against_the_compose_spec() -> None:
    compose_validator().validate(compose())


def test_compose_spec_validator_rejects_a_misspelt_key() -> None:
    broken = compose()
    broken["services"]["deadweight"]["volume"] = broken["services"]["deadweight"].pop("volumes")
    with pytest.raises(jsonschema.ValidationError, match="volume"):
        compose_validator().validate(broken)


#: What a user sets before ``docker compose up`` (the stack's header): the trainer's ids.
COMPOSE_ENV = {"DEADWEIGHT_TRAINER_UID": "1000", "DEADWEIGHT_TRAINER_GID": "1000"}


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR:-default} and ${VAR:?error} with env (COMPOSE_ENV by default): a
    variable set there wins, else its default; a required one that is not set fails."""
    given = COMPOSE_ENV if env is None else env

    def one(match: re.Match[str]) -> str:
        name, kind, rest = match.group(1), match.group(2), match.group(3)
        if name in given:
            return given[name]
        assert kind == ":-", f"${{{name}}} is required ({rest}) and not set"
        return rest

    return re.sub(r"\$\{([A-Z_]+)(?:(:-|:\?)([^}]*))?\}", one, value)


def bind_mounts(service: str) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (relative sources only)."""
    found: dict[str, Path] = {}
    for entry in compose()["services"][service].get("volumes", []):
        source, target = interpolate(entry).split(":")[:2]
        if source.startswith("."):
            found[target] = (COMPOSE_DIR / source).resolve()
    return found


def test_compose_bind_mounts_exist_in_the_repository() -> None:
    for service in compose()["services"]:
        for target, source in bind_mounts(service).items():
            assert source.exists(), f"{service}: {source} (for {target}) is missing"
            assert source.is_relative_to(ROOT), source


def container_root(service: str, tmp_path: Path) -> Path:
    """A directory laid out like the service's filesystem, so configs resolve their paths."""
    root = tmp_path / service
    for target, source in bind_mounts(service).items():
        link = root / target.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(source)
    return root


def test_compose_sidecar_uses_the_image_and_reaches_alertmanager() -> None:
    services = compose()["services"]
    sidecar = services["deadweight"]
    assert sidecar["build"]["context"] == "../.."
    command = sidecar["command"]
    url = command[command.index("--alertmanager-url") + 1]
    assert url == "http://alertmanager:9093"
    assert "alertmanager" in services
    targets = bind_mounts("deadweight")
    assert str(Path(image_flag("--socket")).parent) in targets
    # The state (journal, signing key) is in a named volume at the image's state dir, inside
    # which the sidecar makes its own folder: no host folder a trainer could read.
    state = compose_volumes("deadweight")[image_state_dir()]
    assert state in compose()["volumes"] and image_state_dir() not in targets
    args = serve_args([interpolate(a) for a in command])
    assert Path(args.state_dir).parent == Path(image_state_dir())
    port = dockerfile_instruction("EXPOSE")
    assert any(str(p).endswith(f":{port}") for p in sidecar["ports"])


def compose_volumes(service: str) -> dict[str, str]:
    """Container path -> named volume of a service's volume mounts (bind mounts left out)."""
    found: dict[str, str] = {}
    for entry in compose()["services"][service].get("volumes", []):
        source, target = interpolate(entry).split(":")[:2]
        if not source.startswith((".", "/")):
            found[target] = source
    return found


def test_compose_sidecar_command_is_accepted_by_the_cli() -> None:
    command = compose()["services"]["deadweight"]["command"]
    args = serve_args([interpolate(a) for a in command])
    assert args.alertmanager_url == "http://alertmanager:9093"
    assert args.watch_root == ["/tmp/deadweight-output"]
    # Only the trainer's uid reports; the sockets go to the trainer's group.
    assert args.trainer_uid == [int(COMPOSE_ENV["DEADWEIGHT_TRAINER_UID"])]
    assert args.socket_group == int(COMPOSE_ENV["DEADWEIGHT_TRAINER_GID"])


def test_compose_needs_the_trainers_ids() -> None:
    """Without the trainer's ids the stack does not start (no default that would make the
    trainer's uid the sidecar's)."""
    command = compose()["services"]["deadweight"]["command"]
    with pytest.raises(AssertionError, match=r"DEADWEIGHT_TRAINER_UID.*required"):
        [interpolate(a, {"DEADWEIGHT_TRAINER_GID": "1000"}) for a in command]


def test_compose_prometheus_config_loads_the_alert_rules(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    service = compose()["services"]["prometheus"]
    config_flag = next(a for a in service["command"] if a.startswith("--config.file="))
    root = container_root("prometheus", tmp_path)
    out = run([promtool, "check", "config", str(root / config_flag.split("=", 1)[1].lstrip("/"))])
    match = re.search(r"SUCCESS: (\d+) rules found", out)
    rules = load(ROOT / "alerts" / "deadweight.rules.yml")
    assert match, out
    assert int(match.group(1)) == sum(len(g["rules"]) for g in rules["groups"])


def test_compose_prometheus_scrapes_the_sidecar_under_the_alerts_job_selector() -> None:
    from alerts.rules import DEFAULT_JOB_SELECTOR

    config = load(COMPOSE_DIR / "prometheus" / "prometheus.yml")
    pattern = re.fullmatch(r'job=~"(.*)"', DEFAULT_JOB_SELECTOR)
    assert pattern
    port = dockerfile_instruction("EXPOSE")
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    sidecar_jobs = [j for name, j in jobs.items() if re.fullmatch(pattern.group(1), name)]
    assert len(sidecar_jobs) == 1
    targets = sidecar_jobs[0]["static_configs"][0]["targets"]
    assert targets == [f"deadweight:{port}"]
    am = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == ["alertmanager:9093"]


def test_compose_alertmanager_config_passes_amtool(tmp_path: Path) -> None:
    amtool = require_binary("amtool")
    service = compose()["services"]["alertmanager"]
    config_flag = next(a for a in service["command"] if a.startswith("--config.file="))
    root = container_root("alertmanager", tmp_path)
    run([amtool, "check-config", str(root / config_flag.split("=", 1)[1].lstrip("/"))])


def test_compose_grafana_provisions_the_dashboards_and_their_datasource(tmp_path: Path) -> None:
    service = compose()["services"]["grafana"]
    root = container_root("grafana", tmp_path)
    provisioning = root / "etc" / "grafana" / "provisioning"
    providers = [p for f in sorted((provisioning / "dashboards").glob("*.y*ml"))
                 for p in load(f)["providers"]]
    provided = [d for p in providers
                for d in sorted((root / p["options"]["path"].lstrip("/")).rglob("*.json"))]
    # Every dashboard in dashboards/ is loaded, and nothing else is.
    expected = sorted(p.name for p in (ROOT / "dashboards").glob("deadweight-*.json"))
    assert expected
    assert sorted(d.name for d in provided) == expected
    datasources = [d for f in sorted((provisioning / "datasources").glob("*.y*ml"))
                   for d in load(f)["datasources"]]
    prometheus = [d for d in datasources if d["type"] == "prometheus"]
    assert len(prometheus) == 1
    url = re.sub(r"\$\{(\w+)\}", lambda m: str(service["environment"][m.group(1)]),
                 prometheus[0]["url"])
    assert url == "http://prometheus:9090"
    assert "prometheus" in compose()["services"]
    for path in provided:
        board = json.loads(path.read_text())
        assert board.get("title") and board.get("panels"), path
        for uid in datasource_uids(board):
            assert uid == prometheus[0]["uid"] or uid.startswith("$"), (path, uid)


def datasource_uids(node: Any) -> set[str]:
    """Every datasource uid a dashboard references (panels, targets, variables)."""
    found: set[str] = set()
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict) and isinstance(ds.get("uid"), str):
            found.add(ds["uid"])
        for value in node.values():
            found |= datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            found |= datasource_uids(value)
    return found
