"""The Kubernetes manifests: schema-valid, rendered overlays consistent, generated copies in sync, and the
autoscalers and the inference gateway's endpoint picker reading metrics that Sluice really exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sluice.metrics.prometheus import SluiceMetrics, render_latest
from sluice.metrics.vllm_names import CacheConfigInfo
from sluice.service.bench import gen_k8s
from tests.support import REPO

K8S = REPO / "k8s"
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())  # oldest supported, newest known
CRD_SCHEMAS = yaml.safe_load((K8S / "crd-schemas.yaml").read_text())
# Overlay -> the device its Sluice pods run on; "gpu+keda" is the gpu overlay with the KEDA component added.
DEVICE = {"cpu": "cpu", "gpu": "gpu", "gpu+keda": "gpu", "inference-gateway": "gpu"}
OVERLAYS = tuple(DEVICE)
# What the endpoint picker (Gateway API Inference Extension v1.x) reads when run with its built-in configuration,
# as its core metrics extractor defines them: queue, running, KV use (0..1), LoRA info (labels), cache info.
EPP_DEFAULT_METRICS = {
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:lora_requests_info", "vllm:cache_config_info",
}
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def kustomize_cmd() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Overlay name -> rendered documents; 'gpu+keda' is the gpu overlay with the KEDA component added."""
    cmd = kustomize_cmd()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed to render the overlays")
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy)  # add the component in a copy, as an operator would in their overlay
    with open(copy / "overlays" / "gpu" / "kustomization.yaml", "a") as f:
        f.write("components:\n  - ../../components/keda\n")
    out = {}
    for name in OVERLAYS:
        root = copy if "+" in name else K8S
        path = root / "overlays" / name.split("+")[0]
        done = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        out[name] = [d for d in yaml.safe_load_all(done.stdout) if d]
    return out


def by_kind(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def sluice_deployment(docs: list[dict]) -> dict:
    return by_kind(docs, "Deployment", "sluice")


def raw_manifests() -> list[tuple[Path, dict]]:
    """Every complete manifest file (not kustomizations or patches) under k8s/."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "crd-schemas.yaml") or "patch" in path.name:
            continue
        if path.parent.name == "prometheus-adapter":
            continue  # Helm values, checked below
        out.extend((path, d) for d in yaml.safe_load_all(path.read_text()) if d)
    return out


def validate(doc: dict) -> None:
    """Schema-validate one object: Kubernetes' OpenAPI for built-in kinds, crd-schemas.yaml for CRDs."""
    crd = CRD_SCHEMAS["kinds"].get(f"{doc['apiVersion']}/{doc['kind']}")
    if crd is not None:
        schema = {"$defs": CRD_SCHEMAS["$defs"], **crd}
        jsonschema.Draft202012Validator(schema).validate(doc)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)
    for key in ("labels", "annotations"):
        for k, v in doc["metadata"].get(key, {}).items():
            assert isinstance(v, str), f"{doc['kind']} {key} {k} must be a string"


def exported_metric_names(vllm_names: bool = False) -> set[str]:
    """Sample names `/metrics` exposes, as prometheus_client renders them (with --vllm-metric-names or not)."""
    reg = CollectorRegistry()
    SluiceMetrics("m", reg, vllm_names=CacheConfigInfo(16, True) if vllm_names else None)
    body, _ = render_latest(reg)
    return {s.name for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a simple PromQL expression selects (identifiers directly followed by a label matcher)."""
    return set(re.findall(r"([a-zA-Z_:][\w:]*)\s*\{", expr))


# --- schemas -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,doc", raw_manifests(), ids=lambda v: v.name if isinstance(v, Path) else "")
def test_manifest_files_validate(path, doc):
    validate(doc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlays_validate(rendered, overlay):
    kinds = [d["kind"] for d in rendered[overlay]]
    for doc in rendered[overlay]:
        validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "sluice", f"{doc['kind']} outside the namespace"
        for key in ("labels",):
            for k, v in doc["metadata"].get(key, {}).items():
                assert LABEL_VALUE.match(v) and len(v) <= 63, f"bad label {k}={v!r}"
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule",
            "ConfigMap"} <= set(kinds)
    if overlay.endswith("keda"):
        assert "ScaledObject" in kinds and "HorizontalPodAutoscaler" not in kinds  # never two autoscalers
    else:
        assert "HorizontalPodAutoscaler" in kinds and "ScaledObject" not in kinds


def test_crd_schemas_reject_mistakes():
    doc = yaml.safe_load((K8S / "base" / "servicemonitor.yaml").read_text())
    doc["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)
    so = yaml.safe_load((K8S / "components" / "keda" / "scaledobject.yaml").read_text())
    so["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA wants strings
    with pytest.raises(jsonschema.ValidationError):
        validate(so)


# --- the Deployment ----------------------------------------------------------------------------------------


def container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_probes_shutdown_security_and_resources(rendered, overlay):
    dep = sluice_deployment(rendered[overlay])
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert c["startupProbe"]["httpGet"]["path"] in ("/ready", "/health")
    startup_budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert startup_budget >= 300, "the startup probe must cover a model download and load"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"

    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    shutdown_timeout = float(env(c)["SLUICE_SHUTDOWN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + shutdown_timeout + 5

    assert pod["securityContext"]["runAsNonRoot"] is True
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {"/tmp", "/models"} <= set(mounts) and set(mounts.values()) <= set(volumes)
    assert env(c)["SLUICE_CACHE_DIR"].startswith("/models/")  # the model cache lands on the volume

    res = c["resources"]
    assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])
    if DEVICE[overlay] == "gpu":
        assert res["limits"]["nvidia.com/gpu"] == "1" and env(c)["SLUICE_DEVICE"] == "cuda"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    else:
        assert "nvidia.com/gpu" not in res["limits"] and env(c)["SLUICE_DEVICE"] == "cpu"
    assert c["image"].endswith("-cuda" if DEVICE[overlay] == "gpu" else "-cpu")


def test_env_names_are_real_sluice_flags(rendered):
    """Every SLUICE_* variable the manifests set is a config knob the CLI reads."""
    from dataclasses import fields

    from sluice.service.config import SluiceConfig

    knobs = {f"SLUICE_{f.name.upper()}" for section in fields(SluiceConfig) for f in fields(section.default_factory)}
    for overlay in OVERLAYS:
        names = {n for n in env(container(sluice_deployment(rendered[overlay]))) if n.startswith("SLUICE_")}
        assert names <= knobs, names - knobs


def test_service_pdb_monitor_and_autoscaler_point_at_the_deployment(rendered):
    docs = rendered["cpu"]
    dep, svc = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in container(dep)["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    assert by_kind(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    mon = by_kind(docs, "ServiceMonitor")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    assert mon["spec"]["endpoints"][0]["path"] == "/metrics"
    # job label = the Service's value of jobLabel; the SluiceTargetDown alert matches on it
    assert "sluice" in svc["metadata"]["labels"][mon["spec"]["jobLabel"]]
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}
    so = by_kind(rendered["gpu+keda"], "ScaledObject")
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]


# --- the scaling signal ------------------------------------------------------------------------------------


def test_autoscalers_scale_on_an_exported_metric(rendered):
    exported = exported_metric_names()
    hpa = by_kind(rendered["cpu"], "HorizontalPodAutoscaler")
    (metric,) = [m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    hpa_metric = metric["pods"]["metric"]["name"]

    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    rules = adapter["rules"]["custom"]
    served = [r for r in rules if r["name"]["as"] == hpa_metric]
    assert len(served) == 1, f"prometheus-adapter exposes no custom metric named {hpa_metric}"
    rule = served[0]
    (series,) = promql_metric_names(rule["seriesQuery"])
    assert series in exported, f"adapter rule reads {series}, which /metrics does not export"
    assert re.fullmatch(rule["name"]["matches"], series)
    assert {"<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"} <= set(re.findall(r"<<\.\w+>>", rule["metricsQuery"]))
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # a Pods metric needs per-pod series

    so = by_kind(rendered["gpu+keda"], "ScaledObject")
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    names = promql_metric_names(trigger["metadata"]["query"])
    assert names and names <= exported, names - exported
    assert series in names, "the HPA and KEDA should scale on the same signal"
    # The same per-replica target either way.
    assert float(trigger["metadata"]["threshold"]) == float(metric["pods"]["target"]["averageValue"])


# --- the inference gateway --------------------------------------------------------------------------------

GATEWAY = K8S / "overlays" / "inference-gateway"


def test_inference_gateway_wires_pool_picker_route_and_objective(rendered):
    docs = rendered["inference-gateway"]
    dep, pool = sluice_deployment(docs), by_kind(docs, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [container(dep)["ports"][0]["containerPort"]]

    ref = pool["spec"]["endpointPickerRef"]
    epp_svc = by_kind(docs, "Service", ref["name"])
    epp = by_kind(docs, "Deployment", "sluice-epp")
    (svc_port,) = [p for p in epp_svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp_ports = {p["name"]: p["containerPort"] for p in container(epp)["ports"]}
    assert epp_ports[svc_port["targetPort"]] == 9002 and svc_port["appProtocol"] == "http2"
    assert epp_svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    args = container(epp)["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    assert container(epp)["image"].startswith("registry.k8s.io/gateway-api-inference-extension/epp:v")

    sa = epp["spec"]["template"]["spec"]["serviceAccountName"]
    binding = by_kind(docs, "RoleBinding")
    assert {"kind": "ServiceAccount", "name": sa, "namespace": "sluice"} in binding["subjects"]
    by_kind(docs, "ServiceAccount", sa)
    rules = by_kind(docs, "Role", binding["roleRef"]["name"])["rules"]
    granted = {(g, r) for rule in rules if {"get", "list", "watch"} <= set(rule["verbs"])
               for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
            ("inference.networking.x-k8s.io", "inferenceobjectives")} <= granted

    route = by_kind(docs, "HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "sluice"}]
    assert by_kind(docs, "InferenceObjective")["spec"]["poolRef"]["name"] == pool["metadata"]["name"]


def test_endpoint_picker_reads_metrics_sluice_exports(rendered):
    """The picker's metric names (its flags, else its vLLM defaults) are on /metrics as the overlay runs Sluice."""
    docs = rendered["inference-gateway"]
    args = container(by_kind(docs, "Deployment", "sluice-epp"))["args"]
    flagged = {a.split("=", 1)[1].split("{")[0] for a in args if a.split("=")[0].endswith("-metric")}
    reads = flagged or EPP_DEFAULT_METRICS
    vllm_names = env(container(sluice_deployment(docs))).get("SLUICE_VLLM_METRIC_NAMES", "").lower() in ("1", "true")
    exported = exported_metric_names(vllm_names)
    assert reads <= exported, f"the endpoint picker reads {reads - exported}, which /metrics does not export"
    assert not EPP_DEFAULT_METRICS & exported_metric_names(), "vLLM names leak out without the flag"


def test_crd_schemas_reject_gateway_mistakes():
    pool = yaml.safe_load((GATEWAY / "inferencepool.yaml").read_text())
    validate(pool)
    for mistake in (
        lambda p: p["spec"].update(targetPortNumber=8000),  # the v1alpha2 spelling
        lambda p: p["spec"]["endpointPickerRef"].pop("port"),  # a Service reference needs its port
        lambda p: p["spec"]["endpointPickerRef"].update(failureMode="FailOpn"),
        lambda p: p["spec"]["targetPorts"].append({"number": 70000}),
    ):
        bad = yaml.safe_load(yaml.safe_dump(pool))
        mistake(bad)
        with pytest.raises(jsonschema.ValidationError):
            validate(bad)
    route = yaml.safe_load((GATEWAY / "httproute.yaml").read_text())
    route["spec"]["rules"][0]["backendRefs"] = [{"name": "sluice"}]  # a Service backend without a port
    with pytest.raises(jsonschema.ValidationError):
        validate(route)
    objective = yaml.safe_load((GATEWAY / "inferenceobjective.yaml").read_text())
    objective["spec"]["criticality"] = "Critical"  # InferenceModel's field, gone from InferenceObjective
    with pytest.raises(jsonschema.ValidationError):
        validate(objective)


# --- generated copies --------------------------------------------------------------------------------------


def test_generated_manifests_are_in_sync_with_metrics():
    for path, text in gen_k8s.render().items():
        assert path.exists(), f"{path} missing: run `python -m sluice.service.bench.gen_k8s`"
        assert path.read_text() == text, f"{path} is stale: run `python -m sluice.service.bench.gen_k8s`"
    cm = yaml.safe_load((K8S / "base" / "grafana-dashboard.yaml").read_text())
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["sluice.json"] == gen_k8s.DASHBOARD.read_text()
    rule = yaml.safe_load((K8S / "base" / "prometheusrule.yaml").read_text())
    assert rule["spec"] == yaml.safe_load(gen_k8s.ALERTS.read_text())


def test_generated_configmap_fits_kubernetes_limits():
    text = (K8S / "base" / "grafana-dashboard.yaml").read_text()
    assert len(text.encode()) < 256 * 1024  # kubectl apply keeps a copy in an annotation capped at 256 KiB


# --- the image ---------------------------------------------------------------------------------------------


def test_dockerfile_matches_project_and_deployment(rendered):
    text = (K8S / "Dockerfile").read_text()
    # every top-level package of the project (tests aside) must reach the image
    packages = sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")
    assert {"service", "scheduling", "kvcache", "metrics"} <= set(packages)
    for pkg in packages:
        assert re.search(rf"^COPY {pkg} \./{pkg}$", text, re.M), f"Dockerfile does not copy package {pkg}"
    ignore = (K8S / "Dockerfile.dockerignore").read_text().split()
    for pkg in packages:
        assert f"!{pkg}" in ignore
    (user,) = re.findall(r"^USER (\d+)", text, re.M)
    dep = by_kind(rendered["cpu"], "Deployment")
    assert int(user.split(":")[0]) == dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    (port,) = re.findall(r"^EXPOSE (\d+)", text, re.M)
    assert int(port) == container(dep)["ports"][0]["containerPort"]
    assert 'ENTRYPOINT ["sluice", "serve"]' in text and '"--host", "0.0.0.0"' in text
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}", text, re.M) and "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text  # CPU default, CUDA by build arg
