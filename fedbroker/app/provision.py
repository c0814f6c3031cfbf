"""`fedbroker provision project.yaml --out DIR`: one kit per participant, so a site joins from its own
network with nothing but its kit (the role NVFlare's provisioning plays).

    DIR/ca/                      the project's CA (its key signs certificates; it goes in no kit)
    DIR/server/                  the coordinator and the aggregation service (and the broker's TLS): server
                                 certificates with their public and in-cluster names, the token tables
                                 (SHA-256 only), the broker's users, configs, start scripts, and a
                                 Kubernetes overlay (`kubectl kustomize DIR/server`) that exposes AMQPS 5671
                                 and gRPC over TLS through LoadBalancer Services
    DIR/sites/<name>/            a data owner: the CA certificate, its token, its broker URL, worker.yaml,
                                 start.sh
    DIR/scientists/<name>/       a data scientist: the CA certificate, its token, fedbroker.yaml for the CLI

Every participant proves who it is twice: its bearer token, and the client certificate it presents for
mutual TLS (the services and the broker refuse a connection without one the project CA signed). A kit
holds only what its participant needs: its own private keys and no one else's (the CA's key stays in
DIR/ca); every secret file is 0600 and every kit folder 0700. Paths inside a kit's configs are relative to the kit
(its start script changes into it first). The project file is checked whole before anything is written,
every problem named by its field.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import importlib.util
import ipaddress
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedbroker.auth import ROLE_COORDINATOR, ROLE_SUBMITTER, ROLE_VIEWER, ROLE_WORKER, generate_token, hash_token
from fedbroker.config import load_config
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.yamltext import load_yaml

MAX_PROJECT_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")   # a site's or person's name: a worker id, a token identity
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
K8S_NAMESPACE = "fedbroker"
# the base manifests' in-cluster Service names: each server certificate also carries them
IN_CLUSTER = {"coordinator": "fedbroker-coordinator", "aggregator": "fedbroker-aggregator", "broker": "rabbitmq"}


def _k8s_base() -> Path:
    """deploy/k8s/base, which a wheel or the image installs as `fedbroker.k8s_base` (data, no code): a kit is
    provisioned from an installed fedbroker, not only from a checkout."""
    spec = importlib.util.find_spec("fedbroker.k8s_base")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location, "kustomization.yaml").is_file():
            return Path(location)
    return Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base"  # a checkout on PYTHONPATH only


BASE = _k8s_base()
WORKER_MANIFESTS = ("workers.yaml", "worker-hospital-a.yaml", "worker-hospital-b.yaml")


@dataclass(frozen=True)
class Site:
    name: str
    categories: tuple[str, ...]
    worker: Mapping[str, Any]          # the rest of its worker section (dataset, dp, partition, ...)


@dataclass(frozen=True)
class Person:
    name: str
    role: str


@dataclass(frozen=True)
class Project:
    name: str
    host: str                          # the public name (or address) sites reach the server by
    sans: tuple[str, ...] = ()         # more names or addresses for the server certificates
    listen: str = "0.0.0.0"            # where the server processes bind (the start scripts)
    coordinator_port: int = 50052
    aggregator_port: int = 50051
    broker_port: int = 5671
    namespace: str = "fedbroker"       # the broker's topology prefix (broker.namespace)
    validity_days: int = 365
    sites: tuple[Site, ...] = ()
    scientists: tuple[Person, ...] = field(default_factory=tuple)


def load_project(path: str | os.PathLike[str]) -> Project:
    with open(path, "rb") as fh:
        raw = load_yaml(fh.read(MAX_PROJECT_BYTES + 1), where=str(path), max_bytes=MAX_PROJECT_BYTES)
    return parse_project(raw)


def parse_project(raw: Any) -> Project:
    """A project from its YAML mapping; every problem at once (ConfigErrors), each naming its field."""
    problems: list[ConfigError] = []

    def need(cond: bool, where: str, what: str) -> bool:
        if not cond:
            problems.append(ConfigError(where, what))
        return cond

    if not isinstance(raw, Mapping):
        raise ConfigError("project", "must be a mapping with name, server, sites and scientists")
    known = {"name", "server", "sites", "scientists", "validity_days"}
    for key in raw:
        need(key in known, str(key), f"unknown setting; known: {', '.join(sorted(known))}")
    name = raw.get("name")
    need(isinstance(name, str) and bool(_NAME.fullmatch(name)), "name",
         "must be 1-63 letters, digits, '_', '.' or '-'")
    server = raw.get("server") or {}
    if not need(isinstance(server, Mapping), "server", "must be a mapping"):
        server = {}
    skeys = {"host", "sans", "listen", "coordinator_port", "aggregator_port", "broker_port", "namespace"}
    for key in server:
        need(key in skeys, f"server.{key}", f"unknown setting; known: {', '.join(sorted(skeys))}")
    host = server.get("host")
    need(isinstance(host, str) and _is_host(host), "server.host",
         "must be the DNS name or IP address the sites reach the server by")
    sans = server.get("sans", [])
    if need(isinstance(sans, list) and all(isinstance(s, str) for s in sans), "server.sans",
            "must be a list of DNS names or IP addresses"):
        for i, s in enumerate(sans):
            need(_is_host(s), f"server.sans[{i}]", f"not a DNS name or IP address: {s!r}")
    ports = {}
    for key, default in (("coordinator_port", 50052), ("aggregator_port", 50051), ("broker_port", 5671)):
        value = server.get(key, default)
        need(isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535, f"server.{key}",
             f"must be a port in [1, 65535], got {value!r}")
        ports[key] = value
    listen = server.get("listen", "0.0.0.0")
    need(isinstance(listen, str) and _is_host(listen), "server.listen", "must be an address to bind")
    namespace = server.get("namespace", "fedbroker")
    need(isinstance(namespace, str) and bool(_NAME.fullmatch(namespace)), "server.namespace",
         "must be 1-63 letters, digits, '_', '.' or '-'")
    validity = raw.get("validity_days", 365)
    need(isinstance(validity, int) and not isinstance(validity, bool) and 1 <= validity <= 3650, "validity_days",
         f"must be a whole number of days in [1, 3650], got {validity!r}")

    sites: list[Site] = []
    raw_sites = raw.get("sites")
    if need(isinstance(raw_sites, list) and bool(raw_sites), "sites", "must list at least one data-owner site"):
        for i, s in enumerate(raw_sites or []):
            where = f"sites[{i}]"
            if not need(isinstance(s, Mapping), where, "must be a mapping with a name"):
                continue
            for key in s:
                need(key in {"name", "categories", "worker"}, f"{where}.{key}",
                     "unknown setting; known: categories, name, worker")
            sname = s.get("name")
            need(isinstance(sname, str) and bool(_NAME.fullmatch(sname)), f"{where}.name",
                 "must be 1-63 letters, digits, '_', '.' or '-' (it is the worker's id)")
            cats = s.get("categories", ["digits"])
            need(isinstance(cats, list) and bool(cats) and all(isinstance(c, str) for c in cats),
                 f"{where}.categories", "must be a non-empty list of data categories")
            worker = s.get("worker", {})
            if need(isinstance(worker, Mapping), f"{where}.worker", "must be a mapping of worker settings"):
                for key in ("id", "categories"):
                    need(key not in worker, f"{where}.worker.{key}", f"is set by the kit: use {where}.name/categories")
                if "id" not in worker and "categories" not in worker:
                    problems += _load_problems(where, {"worker": dict(worker)}, site=str(sname))
            sites.append(Site(str(sname), tuple(str(c) for c in cats) if isinstance(cats, list) else (),
                              dict(worker) if isinstance(worker, Mapping) else {}))
    people: list[Person] = []
    raw_people = raw.get("scientists", [])
    if need(isinstance(raw_people, list), "scientists", "must be a list"):
        for i, p in enumerate(raw_people):
            where = f"scientists[{i}]"
            if not need(isinstance(p, Mapping), where, "must be a mapping with a name"):
                continue
            pname, role = p.get("name"), p.get("role", ROLE_SUBMITTER)
            need(isinstance(pname, str) and bool(_NAME.fullmatch(pname)), f"{where}.name",
                 "must be 1-63 letters, digits, '_', '.' or '-'")
            need(role in (ROLE_SUBMITTER, ROLE_VIEWER), f"{where}.role",
                 f"must be {ROLE_SUBMITTER} or {ROLE_VIEWER}, got {role!r}")
            people.append(Person(str(pname), str(role)))
    names = [s.name for s in sites] + [p.name for p in people] + ["coordinator"]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(ConfigError("sites/scientists", f"the name {dup!r} is used twice (or is 'coordinator'); "
                                                        f"every participant needs its own identity"))
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    return Project(name=str(name), host=str(host), sans=tuple(sans), listen=str(listen),
                   coordinator_port=ports["coordinator_port"], aggregator_port=ports["aggregator_port"],
                   broker_port=ports["broker_port"], namespace=str(namespace), validity_days=int(validity),
                   sites=tuple(sites), scientists=tuple(people))


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return len(text) <= 253 and bool(_HOST.fullmatch(text))


# ----- certificates -----------------------------------------------------------------------------------


class Authority:
    """The project's CA: an EC P-256 key that signs the server certificates."""

    def __init__(self, name: str, days: int) -> None:
        self.days = days
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} fedbroker CA")])
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def server(self, common_name: str, names: Iterable[str]) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) of a TLS server known by `names` (DNS names and IP addresses)."""
        return self._issue(common_name, names, ExtendedKeyUsageOID.SERVER_AUTH)

    def client(self, identity: str) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) a participant presents for mutual TLS, its identity as its CN."""
        return self._issue(identity, [], ExtendedKeyUsageOID.CLIENT_AUTH)

    def _issue(self, common_name: str, names: Iterable[str], usage: x509.ObjectIdentifier) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        alt = [_general_name(n) for n in dict.fromkeys(names)]
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def rabbitmq_password_hash(password: str) -> str:
    """RabbitMQ's rabbit_password_hashing_sha256: base64(salt ‖ SHA-256(salt ‖ password)), 4 random salt bytes."""
    salt = secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


# ----- writing ------------------------------------------------------------------------------------------


class _Kit:
    """One participant's folder: 0700, secrets 0600, everything else 0644."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, mode=0o700, exist_ok=False)
        os.chmod(root, 0o700)

    def write(self, relative: str, data: str | bytes, *, secret: bool = False, executable: bool = False) -> Path:
        path = self.root / relative
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        mode = 0o600 if secret else 0o755 if executable else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.chmod(path, mode)
        return path

    def yaml(self, relative: str, doc: Any, *, header: str = "", secret: bool = False) -> Path:
        return self.write(relative, header + yaml.safe_dump(doc, sort_keys=False), secret=secret)


def provision(project: Project, out: str | os.PathLike[str]) -> dict[str, Path]:
    """Write every kit under `out` (which must not exist yet, or be empty); the kits' folders by participant."""
    root = Path(out)
    if root.exists() and any(root.iterdir()):
        raise ConfigError("--out", f"{root} is not empty: provision into a new folder (kits are never overwritten)")
    if not (BASE / "kustomization.yaml").is_file():
        raise ConfigError("provision", f"the Kubernetes base the server kit needs is missing from this "
                                       f"installation ({BASE}): reinstall fedbroker from its source (pip install .)")
    problems = _kit_config_problems(project)
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    created = not root.exists()
    root.mkdir(parents=True, mode=0o700, exist_ok=True)
    try:
        return _write_kits(project, root)
    except BaseException:
        # nothing half-written stays behind (a CA key, tokens): the folder was new or empty
        if created:
            shutil.rmtree(root, ignore_errors=True)
        else:
            for child in root.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        raise


def _write_kits(project: Project, root: Path) -> dict[str, Path]:
    ca = Authority(project.name, project.validity_days)
    ca_kit = _Kit(root / "ca")
    ca_kit.write("ca.crt", ca.cert_pem())
    ca_kit.write("ca.key", _key_pem(ca.key), secret=True)

    tokens = {"coordinator": generate_token(), **{s.name: generate_token() for s in project.sites},
              **{p.name: generate_token() for p in project.scientists}}
    # one broker user per participant, named for the project too (several projects may share a broker)
    broker_passwords = {"coordinator": secrets.token_urlsafe(24), **{s.name: secrets.token_urlsafe(24)
                                                                      for s in project.sites}}
    kits = {"ca": ca_kit.root, "server": _server_kit(project, root / "server", ca, tokens, broker_passwords)}
    for site in project.sites:
        kits[f"site:{site.name}"] = _site_kit(project, root / "sites" / site.name, ca, site, tokens[site.name],
                                              broker_passwords[site.name])
    for person in project.scientists:
        kits[f"scientist:{person.name}"] = _scientist_kit(project, root / "scientists" / person.name, ca,
                                                          person.name, tokens[person.name])
    return kits


def broker_user(project: Project, who: str) -> str:
    return f"{project.name}-{who}"


def _broker_url(user: str, password: str, host: str, port: int) -> str:
    return f"amqps://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/%2F"


def _client_pair(stem: str) -> dict[str, str]:
    """A config's cert_file/key_file for the client certificate `<stem>.crt`/`<stem>.key`."""
    return {"cert_file": f"{stem}.crt", "key_file": f"{stem}.key"}


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _kit_config_problems(project: Project) -> list[ConfigError]:
    """Every config the kits will hold, loaded as its process will load it, before anything is written: a typo
    or a bad value in a site's worker settings is named by its site here, not found on site."""
    problems = _load_problems("server (aggregator.yaml)", _aggregator_doc(project))
    problems += _load_problems("server (coordinator.yaml)", _coordinator_doc(project))
    problems += _load_problems("scientists (fedbroker.yaml)", _scientist_doc(project))
    for i, site in enumerate(project.sites):
        problems += _load_problems(f"sites[{i}]", _worker_doc(project, site), site=site.name)
    return problems


def _load_problems(where: str, doc: Mapping[str, Any], *, site: str = "") -> list[ConfigError]:
    """What load_config refuses in `doc`, each problem named where it comes from in project.yaml
    (`sites[0].worker.dp.epsilon_budget`, and the site's name)."""
    try:
        load_config(None, environ={}, overrides=doc)  # the operator's FEDBROKER__ variables are not the kit's
        return []
    except ConfigErrors as errors:
        found = errors.errors
    except ConfigError as error:
        found = [error]
    if not site:
        return [ConfigError(f"{where}: {e.field}", e.problem) for e in found]
    # a DP policy names its fields from its own section (dp.epsilon_budget): they are the worker's
    return [ConfigError(f"{where}.{e.field if e.field.startswith('worker.') else 'worker.' + e.field}",
                        f"{e.problem} (site {site!r})") for e in found]


def _server_kit(project: Project, folder: Path, ca: Authority, tokens: dict[str, str],
                passwords: dict[str, str]) -> Path:
    kit = _Kit(folder)
    kit.write("ca.crt", ca.cert_pem())
    public = [project.host, *project.sans]
    for role in ("coordinator", "aggregator", "broker"):
        svc = IN_CLUSTER[role]
        cert, key = ca.server(f"{project.name} {role}", [*public, svc, f"{svc}.{K8S_NAMESPACE}.svc",
                                                         f"{svc}.{K8S_NAMESPACE}.svc.cluster.local"])
        kit.write(f"tls/{role}.crt", cert)
        kit.write(f"tls/{role}.key", key, secret=True)
    cert, key = ca.client("coordinator")  # what the coordinator presents to the aggregation service and the broker
    kit.write("tls/coordinator-client.crt", cert)
    kit.write("tls/coordinator-client.key", key, secret=True)
    aggregator_table = {"coordinator": {"role": ROLE_COORDINATOR, "sha256": hash_token(tokens["coordinator"])},
                        **{s.name: {"role": ROLE_WORKER, "sha256": hash_token(tokens[s.name])} for s in project.sites}}
    coordinator_table = {p.name: {"role": p.role, "sha256": hash_token(tokens[p.name])} for p in project.scientists}
    note = "# SHA-256 of each participant's token (fedbroker/auth.py): the tokens themselves are in their kits\n"
    kit.yaml("tokens/aggregator.yaml", aggregator_table, header=note, secret=True)
    kit.yaml("tokens/coordinator.yaml", coordinator_table or {}, header=note, secret=True)
    kit.write("secrets/coordinator.token", tokens["coordinator"] + "\n", secret=True)
    kit.write("secrets/broker-url",
              _broker_url(broker_user(project, "coordinator"), passwords["coordinator"], project.host, project.broker_port) + "\n",
              secret=True)
    kit.yaml("aggregator.yaml", _aggregator_doc(project),
             header="# The aggregation service (start-aggregator.sh): gRPC over mutual TLS, every call authenticated.\n")
    kit.yaml("coordinator.yaml", _coordinator_doc(project),
             header="# The coordinator (start-coordinator.sh). aggregator.target is the public name: the tasks it sends\n"
                    "# tell the sites' workers where to upload, and each worker only sends its token there.\n")
    kit.write("rabbitmq/definitions.json", json.dumps(_definitions(project, passwords), indent=2) + "\n",
              secret=True)
    kit.write("rabbitmq/rabbitmq.conf", _rabbitmq_conf(tls_dir="/etc/rabbitmq-tls",
                                                       definitions="/etc/rabbitmq-auth/definitions.json"))
    for role in ("aggregator", "coordinator"):
        kit.write(f"start-{role}.sh", _script(f"the {role}", f"{role} --config {role}.yaml"), executable=True)
    kit.write("start.sh", _START_SERVER, executable=True)
    _k8s_overlay(project, kit, passwords["coordinator"], tokens["coordinator"])
    kit.write("README.md", _server_readme(project))
    return folder


def _aggregator_doc(project: Project) -> dict[str, Any]:
    return {"aggregator": {"listen": _target(project.listen, project.aggregator_port),
                           "target": _target(project.host, project.aggregator_port),
                           "tokens_file": "tokens/aggregator.yaml", "spool_dir": "state/spool",
                           "tls": {"cert_file": "tls/aggregator.crt", "key_file": "tls/aggregator.key",
                                   "client_ca_file": "ca.crt"}}}


def _coordinator_doc(project: Project) -> dict[str, Any]:
    return {
        "broker": {"url_file": "secrets/broker-url", "ca_file": "ca.crt", "namespace": project.namespace,
                   **_client_pair("tls/coordinator-client")},
        "aggregator": {"target": _target(project.host, project.aggregator_port)},
        "coordinator": {"listen": _target(project.listen, project.coordinator_port),
                        "target": _target(project.host, project.coordinator_port), "state_dir": "state/coordinator",
                        "tokens_file": "tokens/coordinator.yaml",
                        "tls": {"cert_file": "tls/coordinator.crt", "key_file": "tls/coordinator.key",
                                "client_ca_file": "ca.crt"}},
        "client": {"token_file": "secrets/coordinator.token", "ca_file": "ca.crt",
                   **_client_pair("tls/coordinator-client")},
    }


def _worker_doc(project: Project, site: Site) -> dict[str, Any]:
    worker = {"ledger_path": "state/ledger.json", **site.worker, "id": site.name, "categories": list(site.categories)}
    return {
        "broker": {"url_file": "secrets/broker-url", "ca_file": "ca.crt", "namespace": project.namespace,
                   **_client_pair("tls/client")},
        "aggregator": {"target": _target(project.host, project.aggregator_port)},
        "client": {"token_file": "secrets/token", "ca_file": "ca.crt", **_client_pair("tls/client")},
        "worker": worker,
    }


def _scientist_doc(project: Project) -> dict[str, Any]:
    return {"coordinator": {"target": _target(project.host, project.coordinator_port)},
            "client": {"token_file": "secrets/token", "ca_file": "ca.crt", **_client_pair("tls/client")}}


def _definitions(project: Project, passwords: Mapping[str, str]) -> dict[str, Any]:
    """RabbitMQ definitions: one user per participant, so one site is revoked alone. Everyone is confined to
    the project's broker names; a site reads no other site's task queue. Every bus declares the shared
    topology, and RabbitMQ lets a queue with a dead-letter exchange be declared only by a user who may read
    it and write the exchange: so a site may still read the coordinator's queue (deploy/SECURITY.md)."""
    ns = re.escape(project.namespace)
    everything = f"^{ns}\\..*$"
    users, permissions = [], []
    for who, password in passwords.items():
        user = broker_user(project, who)
        users.append({"name": user, "password_hash": rabbitmq_password_hash(password),
                      "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": []})
        if who == "coordinator":
            allowed = {"configure": everything, "write": everything, "read": everything}
        else:
            own = f"worker\\.{re.escape(who)}"
            allowed = {"configure": f"^{ns}\\.(tasks|control|events|dlx|dead|coordinator|{own})$",
                       "write": f"^{ns}\\.(tasks|control|dlx|dead|coordinator|{own})$",
                       "read": f"^{ns}\\.(tasks|control|events|dlx|coordinator|{own})$"}
        permissions.append({"user": user, "vhost": "/", **allowed})
    return {"users": users, "vhosts": [{"name": "/"}], "permissions": permissions}


def _rabbitmq_conf(*, tls_dir: str, definitions: str) -> str:
    return (
        "# AMQPS only: no plaintext listener. Sites verify the broker against the project CA.\n"
        "listeners.tcp = none\n"
        "listeners.ssl.default = 5671\n"
        f"ssl_options.cacertfile = {tls_dir}/ca.crt\n"
        f"ssl_options.certfile = {tls_dir}/broker.crt\n"
        f"ssl_options.keyfile = {tls_dir}/broker.key\n"
        "# mutual TLS: every participant presents its kit's client certificate (and logs in with its user)\n"
        "ssl_options.verify = verify_peer\n"
        "ssl_options.fail_if_no_peer_cert = true\n"
        "management.tcp.port = 15672\n"
        "prometheus.tcp.port = 15692\n"
        "log.console = true\n"
        "log.file = false\n"
        "loopback_users.guest = true\n"
        "consumer_timeout = 14400000\n"
        f"load_definitions = {definitions}\n"
    )


def _script(what: str, args: str) -> str:
    return (
        "#!/bin/sh\n"
        f"# Start {what} from this kit (from any folder: the kit's paths are relative to it).\n"
        "# FEDBROKER overrides the command, e.g. FEDBROKER='python -m fedbroker'.\n"
        "set -eu\n"
        'cd "$(dirname "$0")"\n'
        "mkdir -p state\n"
        f'exec ${{FEDBROKER:-fedbroker}} {args} "$@"\n'
    )


_START_SERVER = """#!/usr/bin/env bash
# Start the aggregation service and the coordinator from this kit; Ctrl-C stops both, and so does either one
# exiting (a config error, a crash): this script then exits non-zero, so a supervisor sees the server down.
# The broker (RabbitMQ with rabbitmq/rabbitmq.conf and rabbitmq/definitions.json) runs beside them: see README.md.
# bash 4.3 or later (wait -n).
set -u
cd "$(dirname "$0")"
./start-aggregator.sh & aggregator=$!
./start-coordinator.sh & coordinator=$!
stopping=""
trap 'stopping=1; kill $coordinator $aggregator 2>/dev/null' INT TERM
wait -n
status=$?
kill $coordinator $aggregator 2>/dev/null
wait
if [ -z "$stopping" ]; then
    echo "start.sh: a server process exited (status $status): both are stopped" >&2
fi
exit $(( status == 0 ? 1 : status ))
"""


# fedbroker is installed from its source, as the project's README says (it is not on a package index)
_INSTALL = ("Install fedbroker from the source release your operator names (it is not published on PyPI): "
            "`pip install torch==2.13.0` first (the CPU or the CUDA build you need; pinned, so nothing pulls "
            "another), then `pip install .` in the source folder. That gives you the `fedbroker` command.")


def _site_kit(project: Project, folder: Path, ca: Authority, site: Site, token: str, password: str) -> Path:
    kit = _Kit(folder)
    kit.write("ca.crt", ca.cert_pem())
    kit.write("secrets/token", token + "\n", secret=True)
    kit.write("secrets/broker-url", _broker_url(broker_user(project, site.name), password, project.host, project.broker_port) + "\n",
              secret=True)
    cert, key = ca.client(site.name)
    kit.write("tls/client.crt", cert)
    kit.write("tls/client.key", key, secret=True)
    kit.yaml("worker.yaml", _worker_doc(project, site), header=f"# The worker of {site.name} (start.sh). Your data, your DP policy: edit the worker section.\n"
              f"# Keep state/ledger.json (your privacy ledger) across restarts and upgrades.\n")
    kit.write("start.sh", _script(f"the worker of {site.name}", "worker --config worker.yaml"), executable=True)
    kit.write("README.md", (
        f"# {site.name}: your kit for the {project.name} federation\n\n"
        f"1. {_INSTALL} Then edit the `worker` section of `worker.yaml`: your data "
        f"set and your differential-privacy policy (`dp`), which no job can override.\n"
        f"2. Start it: `./start.sh` (or `FEDBROKER='python -m fedbroker' ./start.sh`). It connects out to the "
        f"broker at {_target(project.host, project.broker_port)} (AMQPS) and the aggregation service at "
        f"{_target(project.host, project.aggregator_port)} (gRPC over TLS), both verified against `ca.crt`; "
        f"nothing connects in.\n"
        f"3. Keep `secrets/` and `tls/client.key` private (0600): `secrets/token` and `tls/client.*` are your "
        f"identity, `secrets/broker-url` your broker login. Keep `state/ledger.json`: it records the privacy "
        f"you have spent.\n"))
    return folder


def _scientist_kit(project: Project, folder: Path, ca: Authority, name: str, token: str) -> Path:
    kit = _Kit(folder)
    kit.write("ca.crt", ca.cert_pem())
    kit.write("secrets/token", token + "\n", secret=True)
    cert, key = ca.client(name)
    kit.write("tls/client.crt", cert)
    kit.write("tls/client.key", key, secret=True)
    kit.yaml("fedbroker.yaml", _scientist_doc(project), header="# The CLI's config: run `fedbroker <command> --config fedbroker.yaml` in this folder.\n")
    kit.write("README.md", (
        f"# Your kit for the {project.name} federation\n\n"
        f"{_INSTALL}\n\n"
        f"In this folder:\n\n"
        f"```sh\n"
        f"fedbroker submit job.yaml --config fedbroker.yaml\n"
        f"fedbroker jobs list --config fedbroker.yaml\n"
        f"fedbroker jobs logs JOB_ID --follow --config fedbroker.yaml\n"
        f"fedbroker jobs download JOB_ID --out model --config fedbroker.yaml\n"
        f"```\n\n`secrets/token` is your identity: only you can cancel or download the jobs you submit.\n\n"
        f"Without `--config fedbroker.yaml` (elsewhere, or with `--coordinator "
        f"{_target(project.host, project.coordinator_port)}`), give the CLI this kit's files by their absolute "
        f"paths: `FEDBROKER__CLIENT__TOKEN_FILE` (`secrets/token`), `FEDBROKER__CLIENT__CA_FILE` (`ca.crt`), "
        f"`FEDBROKER__CLIENT__CERT_FILE` (`tls/client.crt`) and `FEDBROKER__CLIENT__KEY_FILE` "
        f"(`tls/client.key`). The coordinator speaks mutual TLS only: a call without the CA and the client "
        f"certificate fails with `UNAVAILABLE` (`Socket closed`), whatever the token.\n"))
    return folder


# ----- Kubernetes ---------------------------------------------------------------------------------------


def _k8s_overlay(project: Project, kit: _Kit, broker_password: str, coordinator_token: str) -> None:
    """`kubectl kustomize <server kit>`: the repository's base (copied into k8s/base, without its example
    workers: the sites run outside), TLS everywhere, the kit's token tables, broker users and certificates
    as Secrets, and LoadBalancer Services for AMQPS and the two gRPC ports."""
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
        "broker": {"namespace": project.namespace, "heartbeat_s": 30, "consumer_timeout_s": 14400,
                   "ca_file": f"{tls}/ca.crt", **_client_pair(f"{tls}/coordinator-client")},
        "aggregator": {"listen": "0.0.0.0:50051", "target": _target(project.host, project.aggregator_port),
                       "metrics_port": 9400, "tokens_file": "/etc/fedbroker-tokens/tokens.yaml",
                       "spool_dir": "/var/lib/fedbroker-spool",
                       "tls": {"cert_file": f"{tls}/aggregator.crt", "key_file": f"{tls}/aggregator.key",
                               "client_ca_file": f"{tls}/ca.crt"}},
        "coordinator": {"listen": "0.0.0.0:50052", "target": _target(project.host, project.coordinator_port),
                        "state_dir": "/var/lib/fedbroker", "metrics_port": 9400,
                        "tokens_file": "/etc/fedbroker-tokens/tokens.yaml",
                        "tls": {"cert_file": f"{tls}/coordinator.crt", "key_file": f"{tls}/coordinator.key",
                                "client_ca_file": f"{tls}/ca.crt"}},
        "client": {"ca_file": f"{tls}/ca.crt", **_client_pair(f"{tls}/coordinator-client")},
    })
    kit.write("k8s/coordinator.env", (
        f"FEDBROKER__BROKER__URL={_broker_url(broker_user(project, 'coordinator'), broker_password, 'rabbitmq', 5671)}\n"
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
                "ca.crt", "tls/aggregator.crt", "tls/aggregator.key", "tls/coordinator.crt", "tls/coordinator.key",
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
            {"name": "rabbitmq-config", "behavior": "merge", "files": ["rabbitmq.conf=k8s/rabbitmq.conf"]},
        ],
        "patches": _patches(),
    }, header="# The server side on Kubernetes: `kubectl kustomize .` renders it, `kubectl apply -k .` applies it.\n")
    kit.write("k8s/rabbitmq.conf", _rabbitmq_conf(tls_dir="/etc/rabbitmq-tls",
                                                  definitions="/etc/rabbitmq-auth/definitions.json"))


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
         "value": {"name": "tls", "mountPath": "/etc/rabbitmq-tls", "readOnly": True}},
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


def _server_readme(project: Project) -> str:
    return (
        f"# The {project.name} server kit\n\n"
        f"Sites reach this server at `{project.host}`: AMQPS on {project.broker_port}, the aggregation service "
        f"on {project.aggregator_port} and the coordinator on {project.coordinator_port} (gRPC over TLS). "
        f"Open those three ports, nothing else.\n\n"
        f"## On Kubernetes\n\n"
        f"`kubectl kustomize .` renders the server side (broker, aggregation service, coordinator) with TLS on "
        f"and a LoadBalancer Service per port; `kubectl apply -k .` applies it. Point `{project.host}` at the "
        f"balancers' addresses (`kubectl -n {K8S_NAMESPACE} get svc -l app.kubernetes.io/part-of=fedbroker`).\n\n"
        f"## On a host\n\n"
        f"1. RabbitMQ 3.10 or later (the Kubernetes base runs 4.1) with `rabbitmq/rabbitmq.conf` (point its `ssl_options` and `load_definitions` at "
        f"this kit's `ca.crt`, `tls/broker.*` and `rabbitmq/definitions.json`), listening on "
        f"{project.broker_port}.\n"
        f"2. `./start.sh` starts the aggregation service and the coordinator (or `start-aggregator.sh` and "
        f"`start-coordinator.sh` apart). State lives in `state/`.\n\n"
        f"Keep `tls/*.key`, `tokens/`, `secrets/` and `rabbitmq/definitions.json` private (0600). The CA's key "
        f"is not here: it stays with whoever provisioned the project.\n")


def cmd_provision(args: Any) -> int:
    project = load_project(args.project)
    kits = provision(project, args.out)
    print(f"provisioned {project.name} into {args.out}:")
    for who, folder in kits.items():
        print(f"  {who:<28} {folder}")
    print("hand each participant its own folder only; ca/ (the CA's key) stays with you")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("provision", help="write one kit per participant (server, sites, scientists) from project.yaml")
    p.add_argument("project", help="project.yaml: name, server (host, ports), sites, scientists")
    p.add_argument("--out", required=True, help="a new folder for the kits")
    p.set_defaults(run=cmd_provision)
