"""What each process of the federation reads from its kit: its YAML config, and the broker's users and
rabbitmq.conf. Paths are relative to the kit (its start script changes into it first)."""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from fedbroker.app.provision.project import Project, Site, config_problems
from fedbroker.app.unfilled import names_no_data, placeholders
from fedbroker.errors import ConfigError

# The consumer timeout of held tasks, the same in every kit: the broker's own (rabbitmq.conf), and every
# process's broker.consumer_timeout_s, which the task queues and consumers carry (x-consumer-timeout): a
# worker's consumer argument is the one RabbitMQ 3.12+ applies, so it must agree with the coordinator's.
CONSUMER_TIMEOUT_S = 14400


def target(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets, as gRPC targets and listen addresses take it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def client_pair(stem: str) -> dict[str, str]:
    """A config's cert_file/key_file for the client certificate `<stem>.crt`/`<stem>.key`."""
    return {"cert_file": f"{stem}.crt", "key_file": f"{stem}.key"}


def broker_user(project: Project, who: str) -> str:
    """A participant's broker user, named for the project too (several projects may share a broker)."""
    return f"{project.name}-{who}"


def broker_node(project: Project) -> str:
    """The host kit's RabbitMQ node name (start-broker.sh sets it): its own, so that the kit's broker runs beside
    the host's default node (`rabbit@...`) and `rabbitmqctl -n` (`broker sync --node`) reaches this one."""
    return f"fedbroker-{re.sub(r'[^A-Za-z0-9_-]', '-', project.name)}@localhost"


def broker_url(user: str, password: str, host: str, port: int) -> str:
    """The AMQPS URL a participant logs in with, user and password quoted."""
    return f"amqps://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/%2F"


def _metrics(addr: str, port: int) -> dict[str, Any]:
    """A server process's exporter on a host: on `port` (0: none), bound to `addr` (127.0.0.1: this host only)."""
    return {"metrics_port": port, "metrics_addr": addr} if port else {}


def aggregator_doc(project: Project) -> dict[str, Any]:
    """The aggregation service's config (server kit, aggregator.yaml)."""
    return {"aggregator": {"listen": target(project.listen, project.aggregator_port),
                           "target": target(project.host, project.aggregator_port),
                           **_metrics(project.metrics_addr, project.aggregator_metrics_port),
                           "tokens_file": "tokens/aggregator.yaml", "spool_dir": "state/spool",
                           "tls": {"cert_file": "tls/aggregator.crt", "key_file": "tls/aggregator.key",
                                   "client_ca_file": "ca.crt"}}}


def coordinator_doc(project: Project) -> dict[str, Any]:
    """The coordinator's config (server kit, coordinator.yaml). `worker_broker_users` binds each site's control
    messages to its own broker user: the coordinator refuses a registration, heartbeat or outcome for a site
    that another user published (deploy/SECURITY.md)."""
    return {
        "broker": {"url_file": "secrets/broker-url", "ca_file": "ca.crt", "namespace": project.namespace,
                   "consumer_timeout_s": CONSUMER_TIMEOUT_S, **client_pair("tls/coordinator-client")},
        "aggregator": {"target": target(project.host, project.aggregator_port)},
        "coordinator": {"listen": target(project.listen, project.coordinator_port),
                        "target": target(project.host, project.coordinator_port), "state_dir": "state/coordinator",
                        **_metrics(project.metrics_addr, project.coordinator_metrics_port),
                        "tokens_file": "tokens/coordinator.yaml",
                        "tls": {"cert_file": "tls/coordinator.crt", "key_file": "tls/coordinator.key",
                                "client_ca_file": "ca.crt"},
                        "worker_broker_users": {broker_user(project, site.name): [site.name]
                                                for site in project.sites}},
        "client": {"token_file": "secrets/coordinator.token", "ca_file": "ca.crt",
                   **client_pair("tls/coordinator-client")},
    }


# A site's worker serves /metrics on its own host only (its ε, budget, tasks): the site's Prometheus scrapes it
# there; nothing on the network reads it unless the site sets metrics_addr (project.yaml: sites[i].worker).
SITE_METRICS = {"metrics_port": 9400, "metrics_addr": "127.0.0.1"}


def worker_doc(project: Project, site: Site) -> dict[str, Any]:
    """A site's worker config (worker.yaml): its own worker section, with the id and categories the kit sets.
    It names the coordinator too, which `fedbroker ledger` asks for the site's own record (SiteRecord)."""
    # a site named without its data gets FILL-IN there, which its worker refuses to start with (app/unfilled.py)
    data = placeholders() if names_no_data(site.worker) else {}
    worker = {"ledger_path": "state/ledger.json", **SITE_METRICS, **data, **site.worker, "id": site.name,
              "categories": list(site.categories),
              "coordinator_broker_user": broker_user(project, "coordinator")}  # it trains only the coordinator's tasks
    return {
        "broker": {"url_file": "secrets/broker-url", "ca_file": "ca.crt", "namespace": project.namespace,
                   "consumer_timeout_s": CONSUMER_TIMEOUT_S, **client_pair("tls/client")},
        "aggregator": {"target": target(project.host, project.aggregator_port)},
        "coordinator": {"target": target(project.host, project.coordinator_port)},
        "client": {"token_file": "secrets/token", "ca_file": "ca.crt", **client_pair("tls/client")},
        "worker": worker,
    }


def scientist_doc(project: Project) -> dict[str, Any]:
    """A data scientist's CLI config (fedbroker.yaml)."""
    return {"coordinator": {"target": target(project.host, project.coordinator_port)},
            "client": {"token_file": "secrets/token", "ca_file": "ca.crt", **client_pair("tls/client")}}


def kit_config_problems(project: Project) -> list[ConfigError]:
    """Every config the kits will hold, loaded as its process will load it, before anything is written: a typo
    or a bad value in a site's worker settings is named by its site here, not found on site."""
    problems = config_problems("server (aggregator.yaml)", aggregator_doc(project))
    problems += config_problems("server (coordinator.yaml)", coordinator_doc(project))
    problems += config_problems("scientists (fedbroker.yaml)", scientist_doc(project))
    for i, site in enumerate(project.sites):
        problems += config_problems(f"sites[{i}]", worker_doc(project, site), site=site.name)
    return problems


def rabbitmq_password_hash(password: str) -> str:
    """RabbitMQ's rabbit_password_hashing_sha256: base64(salt ‖ SHA-256(salt ‖ password)), 4 random salt bytes."""
    salt = secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def broker_entry(project: Project, who: str, password: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One participant's RabbitMQ user and its permissions (definitions.json's `users` and `permissions`).
    Everyone is confined to the project's broker names; a site reads no other site's task queue. Every bus
    declares the shared topology, and RabbitMQ lets a queue with a dead-letter exchange be declared only by a
    user who may read it and write the exchange: so a site may still read the coordinator's queue
    (deploy/SECURITY.md)."""
    ns = re.escape(project.namespace)
    everything = f"^{ns}\\..*$"
    user = broker_user(project, who)
    if who == "coordinator":
        allowed = {"configure": everything, "write": everything, "read": everything}
    else:
        own = f"worker\\.{re.escape(who)}"
        allowed = {"configure": f"^{ns}\\.(tasks|control|events|dlx|dead|coordinator|{own})$",
                   "write": f"^{ns}\\.(tasks|control|dlx|dead|coordinator|{own})$",
                   "read": f"^{ns}\\.(tasks|control|events|dlx|coordinator|{own})$"}
    return ({"name": user, "password_hash": rabbitmq_password_hash(password),
             "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": []},
            {"user": user, "vhost": "/", **allowed})


def broker_definitions(project: Project, passwords: Mapping[str, str]) -> dict[str, Any]:
    """RabbitMQ definitions: one user per participant (`broker_entry`), so one site is revoked alone."""
    entries = [broker_entry(project, who, password) for who, password in passwords.items()]
    return {"users": [u for u, _ in entries], "vhosts": [{"name": "/"}], "permissions": [p for _, p in entries]}


def rabbitmq_conf(*, definitions: str) -> str:
    """The broker's config on Kubernetes: AMQPS only, the kit's users loaded from `definitions` (the Secrets'
    mount point); its TLS settings are in advanced.config (`broker_ssl_config`)."""
    return (
        "# AMQPS only: no plaintext listener. Sites verify the broker against the project CA.\n"
        "listeners.tcp = none\n"
        "listeners.ssl.default = 5671\n"
        + _SSL_NOTE +
        "management.tcp.port = 15672\n"
        "prometheus.tcp.port = 15692\n"
        + _COMMON + f"load_definitions = {definitions}\n"
    )


_SSL_NOTE = ("# TLS (the broker's certificate, mutual TLS, the CRL check): rabbitmq/advanced.config, whose ssl_options\n"
             "# would replace any ssl_options.* set here\n")
CRL_DIR = "rabbitmq/crls"   # the server kit's folder of the CA's CRL, as the broker's crl_cache reads it (host)


def _erlang_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def broker_ssl_config(*, cacertfile: str, certfile: str, keyfile: str, crl_dir: str) -> str:
    """The broker's advanced.config: its TLS options whole (RabbitMQ takes a CRL folder only here, and an
    ssl_options here replaces rabbitmq.conf's). Mutual TLS, and every client certificate checked against the
    project's CRL in `crl_dir` (`<hash of the CA's name>.r0`, read on every handshake: a revoked certificate
    gets no TLS handshake). The CRL must be there before the broker starts: without one for the CA, `crl_check,
    peer` refuses every client certificate; `fedbroker provision` writes it there from the start."""
    options = [f"{{cacertfile, {_erlang_string(cacertfile)}}}", f"{{certfile, {_erlang_string(certfile)}}}",
               f"{{keyfile, {_erlang_string(keyfile)}}}", "{verify, verify_peer}", "{fail_if_no_peer_cert, true}",
               "{crl_check, peer}",
               f"{{crl_cache, {{ssl_crl_hash_dir, {{internal, [{{dir, {_erlang_string(crl_dir)}}}]}}}}}}"]
    return ("%% The broker's TLS (RABBITMQ_ADVANCED_CONFIG_FILE): mutual TLS, each participant's certificate checked\n"
            "%% against the project's CRL on every handshake (fedbroker provision revoke; fedbroker broker sync --crl).\n"
            "[{rabbit, [{ssl_options, [\n    " + ",\n    ".join(options) + "]}]}].\n")
_COMMON = ("log.console = true\n"
           "log.file = false\n"
           "loopback_users.guest = true\n"
           f"consumer_timeout = {CONSUMER_TIMEOUT_S * 1000}\n")


def host_rabbitmq_conf(project: Project) -> str:
    """The broker's config on a host (the server kit's rabbitmq/rabbitmq.conf): the same AMQPS with mutual TLS,
    its files named relative to the server kit (RabbitMQ reads a relative path from its working directory: it
    runs in the kit's folder), AMQPS on `server.listen`:`broker_port`, the management UI and the Prometheus
    endpoint on `server.metrics_addr` only (127.0.0.1 unless the project says otherwise)."""
    # every address (IPv4 and IPv6) for a wildcard, else that address; RabbitMQ writes an IPv6 one unbracketed
    public = str(project.broker_port) if project.listen in ("0.0.0.0", "::") else f"{project.listen}:{project.broker_port}"
    return (
        "# RabbitMQ on a host, for this server kit. Paths are relative to the kit: start-broker.sh runs RabbitMQ\n"
        "# with this folder (the server kit's) as its working directory, this file, advanced.config and\n"
        "# enabled_plugins, and the kit's own node name (deploy/OPERATING.md, \"On a host\").\n"
        "# AMQPS only: no plaintext listener. Sites verify the broker against the project CA.\n"
        "listeners.tcp = none\n"
        f"listeners.ssl.default = {public}\n"
        + _SSL_NOTE +
        "# the management UI and /metrics: this host only (server.metrics_addr)\n"
        f"management.tcp.ip = {project.metrics_addr}\n"
        f"management.tcp.port = {project.broker_management_port}\n"
        f"prometheus.tcp.ip = {project.metrics_addr}\n"
        f"prometheus.tcp.port = {project.broker_metrics_port}\n"
        + _COMMON + "load_definitions = rabbitmq/definitions.json\n"
    )


RABBITMQ_PLUGINS = "[rabbitmq_management,rabbitmq_prometheus].\n"


def _scrape_host(addr: str) -> str:
    """Where a local Prometheus reaches a port bound to `addr`: the address itself, loopback for a wildcard."""
    if addr in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{addr}]" if ":" in addr else addr


def server_scrape_doc(project: Project) -> dict[str, Any]:
    """A Prometheus config for the server's host: its aggregation service, coordinator and broker, by the job
    names the project's alert rules use (deploy/prometheus/alerts.yml)."""
    host = _scrape_host(project.metrics_addr)
    jobs = [("fedbroker-aggregator", project.aggregator_metrics_port),
            ("fedbroker-coordinator", project.coordinator_metrics_port), ("rabbitmq", project.broker_metrics_port)]
    return _scrape_doc(project, [(job, f"{host}:{port}") for job, port in jobs if port])


def site_scrape_doc(project: Project, worker: Mapping[str, Any], site: str) -> dict[str, Any]:
    """A Prometheus config for a site's host: its worker's /metrics (worker.yaml's metrics_addr/metrics_port)."""
    port = int(worker.get("metrics_port", 0))
    addr = _scrape_host(str(worker.get("metrics_addr", "127.0.0.1")))
    return _scrape_doc(project, [("fedbroker-worker", f"{addr}:{port}")] if port else [], site=site)


def _scrape_doc(project: Project, targets: list[tuple[str, str]], *, site: str = "") -> dict[str, Any]:
    labels = {"project": project.name, **({"site": site} if site else {})}
    return {"global": {"scrape_interval": "15s", "evaluation_interval": "15s",
                       "external_labels": {"system": "fedbroker"}},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [address], "labels": labels}]}
                               for job, address in targets]}
