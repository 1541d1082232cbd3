"""The Dockerfile, compose file and every manifest under deploy/: linted, schema-checked (the
Kubernetes kinds with kubernetes-validate, KServe's and KEDA's with their CRDs' schemas in
deploy/schemas/), and every command, setting, port and metric they use is one the CLI, the
settings and the service have. Self-tests plant an error in a copy of each manifest."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from service.cli import build_parser
from service.metrics import Metrics
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEPLOY = ROOT / "deploy"

#: the Kubernetes whose schemas kubernetes-validate checks Kubernetes' own kinds against: the
#: API KServe 0.20.0 is built on (KEDA 2.20.2: 1.35)
K8S = "1.34.0"
#: Kubernetes' own kinds the manifests use, by (apiVersion, kind)
CORE = {
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
}
#: custom resources, and their CRD's stored schema (deploy/schemas/README.md says whence)
CRDS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): "kserve-*-inferenceservice-v1beta1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-*-scaledobject-v1alpha1.json",
}
#: the CEL rules (x-kubernetes-validations) of the stored schemas, which jsonschema skips:
#: `_crd_errors` checks each by hand
CEL_RULES = {
    "!has(self.minReplicaCount) || self.minReplicaCount <= "
    "(has(self.maxReplicaCount) ? self.maxReplicaCount : 100)",
}
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed (it is a dev dependency: scripts/bootstrap installs it)"
        )
    return str(path)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=False)


def test_hadolint_finds_nothing():
    done = run(tool("hadolint"), "--failure-threshold", "info", "Dockerfile")
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_compose_file_matches_the_compose_spec():
    done = run(
        tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", "docker-compose.yml"
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _manifests() -> dict[str, list[dict[str, Any]]]:
    """Every YAML file under deploy/: its path from the root, its documents."""
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    return {
        str(p.relative_to(ROOT)): [d for d in yaml.safe_load_all(p.read_text()) if d] for p in files
    }


def _load(path: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / path).read_text())


def _key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc.get("apiVersion", ""), doc.get("kind", "")


def _kubernetes_validate(*paths: str) -> subprocess.CompletedProcess[str]:
    """Strict: an unknown field is an error, as `kubectl apply` (server-side) has it."""
    return run(tool("kubernetes-validate"), "--kubernetes-version", K8S, "--strict", *paths)


def test_every_manifest_has_a_validator():
    manifests = _manifests()
    assert {"deploy/k8s/deployment.yaml", "deploy/kserve/inferenceservice.yaml"} <= set(manifests)
    for path, docs in manifests.items():
        assert len(docs) == 1, f"{path}: one document a file"
        assert _key(docs[0]) in CORE | CRDS.keys(), (
            f"{path}: nothing here validates {_key(docs[0])}"
        )


def test_kubernetes_manifests_validate():
    core = [p for p, docs in _manifests().items() if _key(docs[0]) in CORE]
    done = _kubernetes_validate(*core)
    # a kind it has no schema for is a warning, and passes: none may
    assert done.returncode == 0 and "WARN" not in done.stdout, done.stdout + done.stderr
    assert done.stdout.count(f"against version {K8S.rsplit('.', 1)[0]}") == len(core), done.stdout


def _schema_file(pattern: str) -> Path:
    found = sorted((DEPLOY / "schemas").glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` as the API server applies it with strict field validation (`kubectl apply`'s
    default): an object's unknown field is an error, save under x-kubernetes-preserve-unknown-fields
    (in the stored schemas, only KServe's `status`)."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: _strict(s) for name, s in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    if out.get("type") == "object" and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


@functools.cache
def _crd_validator(pattern: str) -> Draft202012Validator:
    return Draft202012Validator(_strict(json.loads(_schema_file(pattern).read_text())))


@functools.cache
def _object_meta() -> Draft202012Validator:
    """ObjectMeta as kubernetes-validate has it for K8S, strict: a CRD's schema leaves
    `metadata` to the API server."""
    folder = f"kubernetes-json-schema/v{K8S}-local-strict"
    defs = Resource.from_contents(schema_contents(f"{folder}/_definitions.json", K8S))
    meta = schema_contents(f"{folder}/objectmeta-meta-v1.json", K8S)
    return Draft202012Validator(meta, registry=defs @ Registry())


def _crd_errors(doc: dict[str, Any]) -> list[str]:
    """What the API server would answer to `doc`, a custom resource: its metadata, its name, its
    CRD's schema (strict), the CRD's CEL rules."""
    meta = doc.get("metadata", {})
    errors = [f"metadata: {e.message}" for e in _object_meta().iter_errors(meta)]
    if not DNS_1123_LABEL.fullmatch(str(meta.get("name", ""))):
        errors.append(f"metadata.name {meta.get('name')!r}: not a DNS-1123 label")
    body = {k: v for k, v in doc.items() if k != "metadata"}
    for e in _crd_validator(CRDS[_key(doc)]).iter_errors(body):
        errors.append(f"{'.'.join(map(str, e.absolute_path))}: {e.message}")
    spec = doc.get("spec", {})
    if _key(doc)[1] == "ScaledObject" and spec.get("minReplicaCount", 0) > spec.get(
        "maxReplicaCount", 100
    ):
        errors.append("spec: minReplicaCount must be less than or equal to maxReplicaCount")
    return errors


def test_custom_resources_validate_against_their_crds():
    crs = {p: docs[0] for p, docs in _manifests().items() if _key(docs[0]) in CRDS}
    assert {_key(d) for d in crs.values()} == set(CRDS)
    for path, doc in crs.items():
        assert not _crd_errors(doc), (path, _crd_errors(doc))


def test_crd_schemas_are_the_ones_named_and_their_rules_are_checked():
    readme = (DEPLOY / "schemas" / "README.md").read_text()
    rules = set()
    for pattern in CRDS.values():
        path = _schema_file(pattern)
        assert f"`{path.name}`" in readme, f"deploy/schemas/README.md does not name {path.name}"
        text = path.read_text()
        assert text.count("\n") == 1 and json.loads(text)  # minified, as scripts/crd-schemas writes
        rules |= {m for m in re.findall(r'"rule":"((?:[^"\\]|\\.)*)"', text)}
    assert rules == CEL_RULES  # a new rule: check it in _crd_errors, then name it here


#: one error planted in a copy of each manifest: where (keys and indices) and what is put there
PLANTED = {
    "deploy/k8s/deployment.yaml": [  # containerPort: an integer, not a string
        (("spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"), "8000")
    ],
    "deploy/k8s/service.yaml": [(("spec", "ports", 1, "port"), "8001")],  # an integer
    "deploy/k8s/service-headless.yaml": [(("spec", "clusterIp"), "None")],  # misspelled: strict
    "deploy/k8s/hpa.yaml": [(("spec", "maxReplicas"), "8")],  # an integer
    "deploy/k8s/prometheus-adapter-rules.yaml": [(("data", "config.yaml"), {"rules": []})],
    "deploy/kserve/inferenceservice.yaml": [
        (("spec", "predictor", "minReplica"), 2),  # misspelled: only strict rejects it
        (("spec", "predictor", "containers", 0, "ports", 0, "containerPort"), "8000"),
        (("spec", "predictor", "autoScaling", "metrics", 0, "external", "metric", "backend"), "x"),
        (("metadata", "name"), "zen_mla"),  # not a DNS-1123 label
    ],
    "deploy/keda/scaledobject.yaml": [
        (("spec", "maxReplicas"), 8),  # misspelled: only strict rejects it
        (("spec", "triggers", 0, "metadata", "threshold"), 2),  # metadata: strings
        (("spec", "minReplicaCount"), 9),  # above maxReplicaCount: the CEL rule
        (("metadata", "label"), {"a": "b"}),  # ObjectMeta has no `label`
    ],
}


def _planted(path: str, where: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(_load(path))
    parent = doc
    for key in where[:-1]:
        parent = parent[key]
    assert parent.get(where[-1]) != value, (path, where)
    parent[where[-1]] = value
    return doc


def test_an_error_is_planted_in_every_manifest():
    assert set(PLANTED) == set(_manifests())


def test_kubernetes_validate_rejects_the_planted_errors(tmp_path: Path):
    copies = []
    for path, plants in PLANTED.items():
        if _key(_load(path)) in CORE:
            for i, (where, value) in enumerate(plants):
                copies.append((tmp_path / f"{i}-{Path(path).name}", str(where[-1])))
                copies[-1][0].write_text(yaml.safe_dump(_planted(path, where, value)))
    done = _kubernetes_validate(*(str(path) for path, _ in copies))
    assert done.returncode != 0
    for path, key in copies:  # each rejected, and for the error planted
        line = next((s for s in done.stdout.splitlines() if f"ERROR {path} " in s), "")
        assert key in line, (path, key, done.stdout)


@pytest.mark.parametrize(
    ("path", "where", "value"),
    [(p, w, v) for p, plants in PLANTED.items() for w, v in plants if _key(_load(p)) in CRDS],
    ids=lambda x: ".".join(map(str, x)) if isinstance(x, tuple) else None,
)
def test_the_crd_checks_reject_the_planted_errors(path, where, value):
    errors = _crd_errors(_planted(path, where, value))
    assert any(str(where[-1]) in e for e in errors), (path, where, errors)  # for the error planted


def _dockerfile_json_args(instruction: str) -> list[list[str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [json.loads(m) for m in re.findall(rf"^\s*{instruction}\b.*?(\[.*\])\s*$", text, re.M)]


def _cli_accepts(argv: list[str]) -> None:
    assert argv[0] == "zen-mla", argv
    build_parser().parse_args(argv[1:])  # SystemExit on an unknown command or flag


def test_image_commands_are_ones_the_cli_accepts():
    commands = _dockerfile_json_args("CMD") + _dockerfile_json_args("HEALTHCHECK.*CMD")
    assert len(commands) == 2
    for argv in commands:
        _cli_accepts(argv)
    assert commands[0][:4] == ["zen-mla", "serve", "--host", "0.0.0.0"]


def test_compose_commands_and_settings_are_known():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    fields = {f"ZEN_MLA_{name.upper()}" for name in Settings.model_fields}
    grace = Settings().drain_timeout_s
    for name, service in compose["services"].items():
        _cli_accepts(service["healthcheck"]["test"][1:])
        env = service.get("environment", {})
        assert set(env) <= fields, (name, set(env) - fields)
        Settings(**{k.removeprefix("ZEN_MLA_").lower(): v for k, v in env.items()})
        drain = float(env.get("ZEN_MLA_DRAIN_TIMEOUT_S", grace))
        assert float(service["stop_grace_period"].rstrip("s")) > drain, name


def _pod(path: str) -> dict[str, Any]:
    """The pod spec of a Deployment or an InferenceService's predictor."""
    doc = _load(path)
    return doc["spec"]["predictor"] if _key(doc) in CRDS else doc["spec"]["template"]["spec"]


def _env(container: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize(
    "path", ["deploy/k8s/deployment.yaml", "deploy/kserve/inferenceservice.yaml"]
)
def test_kubernetes_commands_and_settings_are_known(path):
    spec = _pod(path)
    container = spec["containers"][0]
    _cli_accepts(container["command"] + container["args"])  # --grpc-port included
    fields = {f"ZEN_MLA_{name.upper()}" for name in Settings.model_fields}
    env = _env(container)
    if path.startswith("deploy/kserve/"):
        assert env.pop("PROTOCOL") == "v2"  # KServe's: the Open Inference Protocol
    assert set(env) <= fields
    assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed
    assert float(container["resources"]["limits"]["cpu"]).is_integer()  # whole, exclusive cores
    assert spec["terminationGracePeriodSeconds"] > float(env["ZEN_MLA_DRAIN_TIMEOUT_S"] or 0)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    names = {p["name"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in names, probe


def _flag(args: list[str], name: str) -> int:
    return int(args[args.index(name) + 1])


def test_ports_match_the_containers():
    container = _pod("deploy/k8s/deployment.yaml")["containers"][0]
    args = container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": _flag(args, "--port"), "grpc": _flag(args, "--grpc-port")}
    labels = _load("deploy/k8s/deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    for path in ("deploy/k8s/service.yaml", "deploy/k8s/service-headless.yaml"):
        spec = _load(path)["spec"]
        assert spec["selector"].items() <= labels.items(), path
        assert {p["name"]: p["port"] for p in spec["ports"]} == ports, path
        assert all(ports[p["targetPort"]] == p["port"] for p in spec["ports"]), path
        grpc = next(p for p in spec["ports"] if p["name"] == "grpc")
        assert grpc["appProtocol"] == "kubernetes.io/h2c", path
    assert _load("deploy/k8s/service-headless.yaml")["spec"]["clusterIP"] == "None"
    # KServe sends its Service's port 80 to the first port, and takes h2c in a name for gRPC
    container = _pod("deploy/kserve/inferenceservice.yaml")["containers"][0]
    args = container["args"]
    ports = [(p["name"], p["containerPort"]) for p in container["ports"]]
    assert ports == [("http1", _flag(args, "--port")), ("h2c", _flag(args, "--grpc-port"))]


def _gauges() -> set[str]:
    text = Metrics().render(0, 0, 0, 0, {})
    return set(re.findall(r"^# TYPE (\S+) gauge$", text, re.M))


def _matchers(query: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', query))


def _prometheus_label(label: str) -> str:
    """A pod label as a `kubernetes-pods` scrape job names it (labelmap)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def test_autoscalers_read_a_gauge_the_service_exports_below_its_queue_cap():
    hpa = _load("deploy/k8s/hpa.yaml")["spec"]
    adapter = yaml.safe_load(
        _load("deploy/k8s/prometheus-adapter-rules.yaml")["data"]["config.yaml"]
    )
    rule = adapter["rules"][0]
    keda = _load("deploy/keda/scaledobject.yaml")["spec"]
    isvc = _load("deploy/kserve/inferenceservice.yaml")
    external = isvc["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"]
    queries = {
        "hpa": hpa["metrics"][0]["pods"]["metric"]["name"],
        "adapter": " ".join([rule["seriesQuery"], rule["name"]["as"], rule["metricsQuery"]]),
        "keda": keda["triggers"][0]["metadata"]["query"],
        "kserve": external["metric"]["query"],
    }
    for who, query in queries.items():
        names = set(re.findall(r"\bzen_mla_\w+", query))
        assert names == {"zen_mla_queue_depth"} and names <= _gauges(), (who, names)
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    deployment = _load("deploy/k8s/deployment.yaml")
    assert hpa["scaleTargetRef"]["name"] == keda["scaleTargetRef"]["name"] == "zen-mla"
    assert deployment["metadata"]["name"] == "zen-mla"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"].items()
    assert _matchers(queries["keda"]).items() - {"namespace": "default"}.items() <= {
        (_prometheus_label(k), v) for k, v in pod_labels
    }
    # KServe labels its pods serving.kserve.io/inferenceservice=<the InferenceService's name>
    label = _prometheus_label("serving.kserve.io/inferenceservice")
    assert _matchers(queries["kserve"]).get(label) == isvc["metadata"]["name"]
    # each target is under the pods' --max-queue: they scale out before they answer 429
    for path, target in [
        ("deploy/k8s/deployment.yaml", hpa["metrics"][0]["pods"]["target"]["averageValue"]),
        ("deploy/k8s/deployment.yaml", keda["triggers"][0]["metadata"]["threshold"]),
        ("deploy/kserve/inferenceservice.yaml", external["target"]["value"]),
    ]:
        cap = int(_env(_pod(path)["containers"][0])["ZEN_MLA_MAX_QUEUE"] or 0)
        assert 0 < float(target) < cap, (path, target, cap)
