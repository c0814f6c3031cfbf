"""The server kit's Kubernetes overlay: `kubectl kustomize <server kit>` renders the server side from the
repository's base, with TLS everywhere and the kit's own secrets, reachable from outside the cluster."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import yaml

from fedbroker.app.provision.configs import (
    CONSUMER_TIMEOUT_S,
    broker_ssl_config,
    broker_url,
    broker_user,
    client_pair,
    coordinator_doc,
    rabbitmq_conf,
    target,
)
from fedbroker.app.provision.folder import KitFolder
from fedbroker.app.provision.project import Project
from fedbroker.errors import ConfigError

K8S_NAMESPACE = "fedbroker"
# the base manifests' in-cluster Service names: each server certificate also carries them
BROKER_TLS = "/etc/rabbitmq-tls"   # the TLS Secret's mount in the broker's pod: its certificates and its CRL folder
IN_CLUSTER = {"coordinator": "fedbroker-coordinator", "aggregator": "fedbroker-aggregator", "broker": "rabbitmq"}


def _k8s_base() -> Path:
    """deploy/k8s/base, which a wheel or the image installs as `fedbroker.k8s_base` (data, no code): a kit is
    provisioned from an installed fedbroker, not only from a checkout."""
    spec = importlib.util.find_spec("fedbroker.k8s_base")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location, "kustomization.yaml").is_file():
            return Path(location)
    return Path(__file__).resolve().parents[4] / "deploy" / "k8s" / "base"  # a checkout on PYTHONPATH only


BASE = _k8s_base()
WORKER_MANIFESTS = ("workers.yaml", "worker-hospital-a.yaml", "worker-hospital-b.yaml")


def check_base() -> None:
    """Refuse to provision, before anything is written, from an installation that lacks the base."""
    if not (BASE / "kustomization.yaml").is_file():
        raise ConfigError("provision", f"the Kubernetes base the server kit needs is missing from this "
                                       f"installation ({BASE}): reinstall fedbroker from its source (pip install .)")


def overlay(project: Project, kit: KitFolder, broker_password: str, coordinator_token: str, crl_name: str) -> None:
    """`kubectl kustomize <server kit>`: the repository's base (copied into k8s/base, without its example
    workers: the sites run outside), TLS everywhere, the kit's token tables, broker users and certificates
    as Secrets, and LoadBalancer Services for AMQPS and the two gRPC ports. `crl_name`: the CRL's file name in
    the broker's CRL folder (broker_crl.crl_file_name)."""
    base = kit.root / "k8s" / "base"
    shutil.copytree(BASE, base)
    for name in WORKER_MANIFESTS:
        (base / name).unlink()
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    kustomization["resources"] = [r for r in kustomization["resources"] if r not in WORKER_MANIFESTS]
    (base / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    tls = "/etc/fedbroker-tls"
    kit.yaml("k8s/config.yaml", {
        "log_level": "INFO",
        "broker": {"namespace": project.namespace, "heartbeat_s": 30, "consumer_timeout_s": CONSUMER_TIMEOUT_S,
                   "ca_file": f"{tls}/ca.crt", **client_pair(f"{tls}/coordinator-client")},
        "aggregator": {"listen": "0.0.0.0:50051", "target": target(project.host, project.aggregator_port),
                       "metrics_port": 9400, "tokens_file": "/etc/fedbroker-tokens/tokens.yaml",
                       "spool_dir": "/var/lib/fedbroker-spool",
                       "tls": {"cert_file": f"{tls}/aggregator.crt", "key_file": f"{tls}/aggregator.key",
                               "client_ca_file": f"{tls}/ca.crt"}},
        "coordinator": {"listen": "0.0.0.0:50052", "target": target(project.host, project.coordinator_port),
                        "state_dir": "/var/lib/fedbroker", "metrics_port": 9400,
                        "tokens_file": "/etc/fedbroker-tokens/tokens.yaml",
                        "tls": {"cert_file": f"{tls}/coordinator.crt", "key_file": f"{tls}/coordinator.key",
                                "client_ca_file": f"{tls}/ca.crt"},
                        "worker_broker_users": coordinator_doc(project)["coordinator"]["worker_broker_users"]},
        "client": {"ca_file": f"{tls}/ca.crt", **client_pair(f"{tls}/coordinator-client")},
    })
    kit.write("k8s/coordinator.env", (
        f"FEDBROKER__BROKER__URL={broker_url(broker_user(project, 'coordinator'), broker_password, 'rabbitmq', 5671)}\n"
        f"FEDBROKER__CLIENT__TOKEN={coordinator_token}\n"), secret=True)
    kit.write("k8s/auth.conf", "load_definitions = /etc/rabbitmq-auth/definitions.json\n")
    kit.write("k8s/public.yaml", yaml.safe_dump_all(_public_objects(), sort_keys=False))
    kit.yaml("kustomization.yaml", {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": K8S_NAMESPACE,
        "resources": ["k8s/base", "k8s/public.yaml"],
        "generatorOptions": {"disableNameSuffixHash": True},
        "secretGenerator": [
            {"name": "fedbroker-server-tls", "options": {"labels": {"app.kubernetes.io/part-of": "fedbroker"}},
             "files": [
                "ca.crt", "crl.pem", f"{crl_name}=crl.pem", "tls/aggregator.crt", "tls/aggregator.key", "tls/coordinator.crt", "tls/coordinator.key",
                "tls/broker.crt", "tls/broker.key", "tls/coordinator-client.crt", "tls/coordinator-client.key"]},
            {"name": "fedbroker-aggregator-tokens", "behavior": "replace", "files": ["tokens.yaml=tokens/aggregator.yaml"]},
            {"name": "fedbroker-coordinator-tokens", "behavior": "replace",
             "files": ["tokens.yaml=tokens/coordinator.yaml"]},
            {"name": "fedbroker-coordinator", "behavior": "replace", "envs": ["k8s/coordinator.env"]},
            {"name": "rabbitmq-auth", "behavior": "replace",
             "files": ["auth.conf=k8s/auth.conf", "definitions.json=rabbitmq/definitions.json"]},
        ],
        "configMapGenerator": [
            {"name": "fedbroker-config", "behavior": "replace", "files": ["config.yaml=k8s/config.yaml"]},
            {"name": "rabbitmq-config", "behavior": "merge", "files": ["rabbitmq.conf=k8s/rabbitmq.conf",
                                                                         "advanced.config=k8s/advanced.config"]},
        ],
        "patches": _patches(),
    }, header="# The server side on Kubernetes: `kubectl kustomize .` renders it, `kubectl apply -k .` applies it.\n")
    kit.write("k8s/rabbitmq.conf", rabbitmq_conf(definitions="/etc/rabbitmq-auth/definitions.json"))
    # the CRL is a key of the TLS Secret, named as the broker's crl_cache looks for it: the Secret's mount is
    # the broker's CRL folder, and `kubectl apply -k` after a revocation updates it there (read per handshake)
    kit.write("k8s/advanced.config", broker_ssl_config(
        cacertfile=f"{BROKER_TLS}/ca.crt", certfile=f"{BROKER_TLS}/broker.crt", keyfile=f"{BROKER_TLS}/broker.key",
        crl_dir=BROKER_TLS))


def _public_objects() -> list[dict[str, Any]]:
    """A LoadBalancer Service per port the sites reach (TLS ends in the pods: the balancer passes TCP through)
    and a NetworkPolicy letting the outside reach exactly that port. They carry the labels the base gives its
    objects (its part-of comes from its kustomization, which these are not in), so
    `kubectl get svc -l app.kubernetes.io/part-of=fedbroker` lists the balancers."""
    part_of = {"app.kubernetes.io/part-of": "fedbroker"}
    out: list[dict[str, Any]] = []
    for name, selector, port in (("broker", {"app.kubernetes.io/name": "rabbitmq"}, 5671),
                                 ("aggregator", {"app.kubernetes.io/name": "fedbroker",
                                                 "app.kubernetes.io/component": "aggregator"}, 50051),
                                 ("coordinator", {"app.kubernetes.io/name": "fedbroker",
                                                  "app.kubernetes.io/component": "coordinator"}, 50052)):
        out.append({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": f"fedbroker-public-{name}",
                                 "labels": {**selector, "app.kubernetes.io/component": name, **part_of}},
                    "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local", "selector": selector,
                             "ports": [{"name": "amqps" if name == "broker" else "grpc-tls", "port": port,
                                        "targetPort": port, "protocol": "TCP"}]}})
        out.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                    "metadata": {"name": f"public-{name}-ingress", "labels": part_of},
                    "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                             "ingress": [{"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}],
                                          "ports": [{"protocol": "TCP", "port": port}]}]}})
    # the coordinator calls the aggregation service by its public name (the one its tasks hand the sites)
    out.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": "coordinator-public-aggregator-egress", "labels": part_of},
                "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fedbroker",
                                                         "app.kubernetes.io/component": "coordinator"}},
                         "policyTypes": ["Egress"],
                         "egress": [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}],
                                     "ports": [{"protocol": "TCP", "port": 50051}]}]}})
    return out


def _patches() -> list[dict[str, Any]]:
    """TLS material mounted where config.yaml and rabbitmq.conf expect it; TCP probes instead of gRPC ones
    (kubelet's gRPC probe speaks no TLS); the broker's AMQPS port."""
    tls_volume = {"name": "tls", "secret": {"secretName": "fedbroker-server-tls", "defaultMode": 0o440}}
    out: list[dict[str, Any]] = []
    for role, port in (("aggregator", 50051), ("coordinator", 50052)):
        ops = [
            {"op": "add", "path": "/spec/template/spec/volumes/-", "value": tls_volume},
            {"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
             "value": {"name": "tls", "mountPath": "/etc/fedbroker-tls", "readOnly": True}},
            {"op": "replace", "path": "/spec/template/spec/containers/0/readinessProbe",
             "value": {"tcpSocket": {"port": port}, "periodSeconds": 10}},
            {"op": "replace", "path": "/spec/template/spec/containers/0/livenessProbe",
             "value": {"tcpSocket": {"port": port}, "initialDelaySeconds": 10, "periodSeconds": 20}},
        ]
        out.append({"target": {"kind": "Deployment", "name": f"fedbroker-{role}"}, "patch": yaml.safe_dump(ops)})
    broker_ops = [
        {"op": "add", "path": "/spec/template/spec/volumes/-", "value": tls_volume},
        {"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
         "value": {"name": "tls", "mountPath": BROKER_TLS, "readOnly": True}},
        {"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
         "value": {"name": "config", "mountPath": "/etc/rabbitmq/advanced.config", "subPath": "advanced.config",
                   "readOnly": True}},
        {"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
         "value": {"name": "auth", "mountPath": "/etc/rabbitmq-auth", "readOnly": True}},
        {"op": "replace", "path": "/spec/template/spec/containers/0/ports/0",
         "value": {"name": "amqps", "containerPort": 5671}},
    ]
    out.append({"target": {"kind": "StatefulSet", "name": "rabbitmq"}, "patch": yaml.safe_dump(broker_ops)})
    for service in ("rabbitmq", "rabbitmq-headless"):
        out.append({"target": {"kind": "Service", "name": service}, "patch": yaml.safe_dump([
            {"op": "replace", "path": "/spec/ports/0", "value": {"name": "amqps", "port": 5671,
                                                                 "targetPort": "amqps"}}])})
    out.append({"target": {"kind": "NetworkPolicy", "name": "rabbitmq-ingress"}, "patch": yaml.safe_dump([
        {"op": "replace", "path": "/spec/ingress/0/ports/0/port", "value": 5671}])})
    out.append({"target": {"kind": "NetworkPolicy", "name": "broker-and-aggregator-egress"}, "patch": yaml.safe_dump([
        {"op": "replace", "path": "/spec/egress/0/ports/0/port", "value": 5671}])})
    return out
