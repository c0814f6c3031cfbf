"""Changes to an issued server kit, made in place and each file whole (`replace_file`): the token tables, the
broker's users, the coordinator's map of sites to broker users, the coordinator's own token and the CRL.

A running service that re-reads one of these files sees the old file or the new one, never half of it. The
Kubernetes overlay builds its Secrets and ConfigMaps from the same files, so `kubectl apply -k` carries a change
to the cluster.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509

from fedbroker.app.broker_crl import crl_file_name
from fedbroker.app.provision.configs import CRL_DIR, broker_entry, broker_user
from fedbroker.app.provision.folder import replace_file, replace_yaml
from fedbroker.app.provision.project import Project
from fedbroker.app.provision.state import Kind
from fedbroker.rpc.auth import TokenTable

TABLE_NOTE = "# SHA-256 of each participant's token (fedbroker/rpc/auth.py): the tokens themselves are in their kits\n"
TABLES = {"aggregator": "tokens/aggregator.yaml", "coordinator": "tokens/coordinator.yaml"}
# which services' tables know a participant of each kind: a site's token also reads its own record on the
# coordinator (SiteRecord); a scientist's opens nothing on the aggregation service
TABLES_OF_KIND = {Kind.SERVER: ("aggregator",), Kind.SITE: ("aggregator", "coordinator"), Kind.SCIENTIST: ("coordinator",)}
CRL_FILE = "crl.pem"               # beside the server kit's ca.crt, where the services read the CA from
DEFINITIONS = "rabbitmq/definitions.json"
COORDINATOR_CONFIGS = ("coordinator.yaml", "k8s/config.yaml")   # on a host, and on Kubernetes


def table_entry(role: str, digests: list[str]) -> dict[str, Any]:
    """A token table's entry: one digest, or the list a rotation keeps (fedbroker/rpc/auth.py reads both)."""
    return {"role": role, "sha256": digests[0] if len(digests) == 1 else list(digests)}


def set_tokens(server: Path, *, kind: Kind, name: str, role: str, digests: list[str]) -> None:
    """Put `name`'s entry (its token digests) in the tables its kind belongs to; no digests: take it out."""
    for table in TABLES_OF_KIND[kind]:
        path = server / TABLES[table]
        entries = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if digests:
            entries[name] = table_entry(role, digests)
        else:
            entries.pop(name, None)
        if entries:
            TokenTable.from_mapping(entries, where=path.name)  # refuse to write a table the services would refuse
        replace_yaml(path, entries, header=TABLE_NOTE, secret=True)


def set_broker_user(server: Path, project: Project, who: str, password: str | None) -> None:
    """`who`'s RabbitMQ user and permissions in the broker's definitions: a new one for `password`, or none."""
    path = server / DEFINITIONS
    doc = json.loads(path.read_text(encoding="utf-8"))
    user = broker_user(project, who)
    doc["users"] = [u for u in doc["users"] if u["name"] != user]
    doc["permissions"] = [p for p in doc["permissions"] if p["user"] != user]
    if password is not None:
        entry, allowed = broker_entry(project, who, password)
        doc["users"].append(entry)
        doc["permissions"].append(allowed)
    replace_file(path, json.dumps(doc, indent=2) + "\n", secret=True)


def set_worker_broker_users(server: Path, project: Project) -> None:
    """The coordinator's `worker_broker_users` (which broker user speaks for which site) for the project's
    active sites, in the host config and the Kubernetes one; every other setting (and the header) kept."""
    users = {broker_user(project, site.name): [site.name] for site in project.sites}
    for name in COORDINATOR_CONFIGS:
        path = server / name
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        header = "".join(itertools.takewhile(lambda line: line.startswith("#"), lines))
        doc = yaml.safe_load(text)
        doc["coordinator"]["worker_broker_users"] = users
        replace_yaml(path, doc, header=header, secret=False)


def set_coordinator_token(server: Path, token: str) -> None:
    """The coordinator's own token, where it reads it on a host and on Kubernetes."""
    replace_file(server / "secrets/coordinator.token", token + "\n", secret=True)
    env = server / "k8s/coordinator.env"
    lines = [f"FEDBROKER__CLIENT__TOKEN={token}" if line.startswith("FEDBROKER__CLIENT__TOKEN=") else line
             for line in env.read_text(encoding="utf-8").splitlines()]
    replace_file(env, "\n".join(lines) + "\n", secret=True)


def write_crl(server: Path, pem: bytes) -> Path:
    """The CA's CRL beside the CA certificate the services use (server kit's crl.pem; readable, like ca.crt), and
    where the broker checks client certificates on a host (rabbitmq/crls/<hash>.r0, configs.CRL_DIR): a broker
    run from this kit refuses a revoked certificate's next handshake as soon as the file is replaced."""
    path = server / CRL_FILE
    replace_file(path, pem, secret=False)
    replace_file(server / CRL_DIR / crl_file_name(x509.load_pem_x509_crl(pem).issuer), pem, secret=False)
    return path
