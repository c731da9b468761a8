"""The inference-gateway overlay's KV cache events, with the precise-prefix-cache component added: what each Sluice
pod publishes (a config `sluice serve` accepts, its port, the topic naming the pod's IP) is what llm-d's scorer in
the picker subscribes to (socket port, topic filter, pod selector) and cuts prompts by (block size)."""

from __future__ import annotations

import json
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from sluice.kvcache.config import CacheConfig
from sluice.service.engine.engine import _default_served_name
from sluice.service.engine.kv_events import KVEventsConfig
from tests.support import REPO

K8S = REPO / "k8s"
COMPONENT = "../../components/precise-prefix-cache"


def kustomize_cmd() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def by_kind(docs: list[dict], kind: str, name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[dict]:
    cmd = kustomize_cmd()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed to render the overlays")
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy)
    overlay = copy / "overlays" / "inference-gateway"
    with open(overlay / "kustomization.yaml", "a") as f:
        f.write(f"components:\n  - {COMPONENT}\n")
    done = subprocess.run([*cmd, str(overlay)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_the_overlay_names_the_component_it_documents():
    text = (K8S / "overlays" / "inference-gateway" / "kustomization.yaml").read_text()
    assert f"#   - {COMPONENT}" in text
    assert (K8S / "overlays" / "inference-gateway" / COMPONENT / "kustomization.yaml").exists()


def test_what_the_component_changes_validates(docs):
    """(tests/k8s/test_k8s.py validates the overlay without it, custom resources included.)"""
    for doc in (by_kind(docs, "Deployment", "sluice-epp"), by_kind(docs, "Deployment", "sluice"),
                by_kind(docs, "ConfigMap", "sluice-epp-precise-prefix-cache")):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        assert doc["metadata"]["namespace"] == "sluice"


def test_sluice_publishes_what_the_scorer_subscribes_to(docs):
    dep = by_kind(docs, "Deployment", "sluice")
    c = container(dep)
    names = [e["name"] for e in c["env"]]
    # Kubernetes expands $(POD_IP) only from a variable defined earlier in the list.
    (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert names.index("POD_IP") < names.index("SLUICE_KV_EVENTS_CONFIG")
    values = env(c)
    cfg = KVEventsConfig.parse(values["SLUICE_KV_EVENTS_CONFIG"])  # what `sluice serve` will accept
    assert cfg is not None and cfg.endpoint.startswith("tcp://*:")
    port = int(cfg.endpoint.rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["kv-events"] == port and c["ports"][0]["name"] == "http"
    served = values.get("SLUICE_SERVED_MODEL_NAME") or _default_served_name(values["SLUICE_MODEL"])
    assert cfg.topic == f"kv@$(POD_IP)@{served}"

    epp = by_kind(docs, "Deployment", "sluice-epp")
    ec = container(epp)
    assert ec["image"].startswith("ghcr.io/llm-d/llm-d-inference-scheduler:v")
    (flag,) = [a for a in ec["args"] if a.startswith("--config-file=")]
    path = flag.split("=", 1)[1]
    (mount,) = [m for m in ec["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    cm = by_kind(docs, "ConfigMap", volume["configMap"]["name"])
    picker = yaml.safe_load(cm["data"][path.rsplit("/", 1)[1]])
    (scorer,) = [p for p in picker["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    params = scorer["parameters"]
    events = params["kvEventsConfig"]
    assert events["discoverPods"] is True and events["podDiscoveryConfig"]["socketPort"] == port
    assert cfg.topic.startswith(events["topicFilter"])
    selector = dict(kv.split("=") for kv in events["podDiscoveryConfig"]["podLabelSelector"].split(","))
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert events["podDiscoveryConfig"]["podNamespace"] == dep["metadata"]["namespace"]
    block_size = int(values.get("SLUICE_BLOCK_SIZE") or CacheConfig().block_size)
    assert params["tokenProcessorConfig"]["blockSize"] == block_size
    used = {p["pluginRef"] for prof in picker["schedulingProfiles"] for p in prof["plugins"]}
    assert used <= {p.get("name", p["type"]) for p in picker["plugins"]}
    assert json.loads(json.dumps(picker))  # plain data, as the picker reads it
