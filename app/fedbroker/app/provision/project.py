"""The project file (project.yaml): who takes part and where the server is, checked whole before any kit is
written, every problem named by its field."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fedbroker.config import load_config
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.yamltext import load_yaml
from fedbroker.rpc.auth import ROLE_SUBMITTER, ROLE_VIEWER

MAX_PROJECT_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")   # a site's or person's name: a worker id, a token identity
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
_NAME_RULE = "must be 1-63 letters, digits, '_', '.' or '-'"
_PROJECT_KEYS = {"name", "server", "sites", "scientists", "validity_days"}
_SERVER_KEYS = {"host", "sans", "listen", "coordinator_port", "aggregator_port", "broker_port", "namespace",
                "metrics_addr", "coordinator_metrics_port", "aggregator_metrics_port", "broker_management_port",
                "broker_metrics_port", "broker_dist_port"}
# the server's own /metrics ports on a host (0: none); on Kubernetes every pod serves 9400
_METRICS_PORTS = (("aggregator_metrics_port", 9401), ("coordinator_metrics_port", 9402))
_SITE_KEYS = {"name", "categories", "worker"}


@dataclass(frozen=True)
class Site:
    """A data owner: its name is its worker's id and its identity in every token table and certificate."""

    name: str
    categories: tuple[str, ...]
    worker: Mapping[str, Any]          # the rest of its worker section (dataset, dp, partition, ...)


@dataclass(frozen=True)
class Person:
    """A data scientist: submits and follows jobs (submitter) or only reads them (viewer)."""

    name: str
    role: str


@dataclass(frozen=True)
class Project:
    """One federation: the server every kit points at, and its participants."""

    name: str
    host: str                          # the public name (or address) sites reach the server by
    sans: tuple[str, ...] = ()         # more names or addresses for the server certificates
    listen: str = "0.0.0.0"            # where the server's public ports bind on a host (the sites reach them)
    metrics_addr: str = "127.0.0.1"    # where its host-only ports bind: /metrics, RabbitMQ's management
    aggregator_metrics_port: int = 9401
    coordinator_metrics_port: int = 9402
    coordinator_port: int = 50052
    aggregator_port: int = 50051
    broker_port: int = 5671
    broker_management_port: int = 15672  # the host kit's broker: its management UI, on metrics_addr
    broker_metrics_port: int = 15692     # ... and its Prometheus endpoint (another broker on the host may hold these)
    broker_dist_port: int = 25671        # ... and its Erlang distribution port, on 127.0.0.1 (the default node: 25672)
    namespace: str = "fedbroker"       # the broker's topology prefix (broker.namespace)
    validity_days: int = 365
    sites: tuple[Site, ...] = ()
    scientists: tuple[Person, ...] = field(default_factory=tuple)


class _Server(NamedTuple):
    host: str
    sans: tuple[str, ...]
    listen: str
    metrics_addr: str
    aggregator_metrics_port: int
    coordinator_metrics_port: int
    coordinator_port: int
    aggregator_port: int
    broker_port: int
    broker_management_port: int
    broker_metrics_port: int
    broker_dist_port: int
    namespace: str


class _Problems:
    """The problems found so far: a project file is refused with all of them at once, not the first only."""

    def __init__(self) -> None:
        self.found: list[ConfigError] = []

    def add(self, where: str, what: str) -> None:
        """One more problem, named by its field."""
        self.found.append(ConfigError(where, what))

    def need(self, cond: bool, where: str, what: str) -> bool:
        """Record `where: what` unless `cond` holds; `cond`, so a check can guard the checks under it."""
        if not cond:
            self.add(where, what)
        return cond

    def entries(self, raw: object, section: str, problem: str, *,
                allow_empty: bool) -> Iterator[tuple[str, Mapping[Any, Any]]]:
        """A list section's entries, each a mapping with its field path (`sites[0]`); `problem` when the section
        is not a list (or is empty, unless `allow_empty`), and an entry that is not a mapping is one too."""
        if not isinstance(raw, list) or not (raw or allow_empty):
            self.add(section, problem)
            return
        for i, entry in enumerate(raw):
            where = f"{section}[{i}]"
            if self.need(isinstance(entry, Mapping), where, "must be a mapping with a name"):
                yield where, entry

    def known_keys(self, section: Mapping[Any, Any], prefix: str, known: set[str]) -> None:
        """A setting this file does not know is a typo, never silently ignored."""
        for key in section:
            self.need(key in known, f"{prefix}{key}", f"unknown setting; known: {', '.join(sorted(known))}")


def load_project(path: str | os.PathLike[str]) -> Project:
    """The project file at `path`, read with the size limit every YAML input here has."""
    with open(path, "rb") as fh:
        raw = load_yaml(fh.read(MAX_PROJECT_BYTES + 1), where=str(path), max_bytes=MAX_PROJECT_BYTES)
    return parse_project(raw)


def parse_project(raw: object) -> Project:
    """A project from its YAML mapping; every problem at once (ConfigErrors), each naming its field."""
    if not isinstance(raw, Mapping):
        raise ConfigError("project", "must be a mapping with name, server, sites and scientists")
    check = _Problems()
    check.known_keys(raw, "", _PROJECT_KEYS)
    name = raw.get("name")
    check.need(_is_name(name), "name", _NAME_RULE)
    server = _parse_server(raw.get("server") or {}, check)
    validity = raw.get("validity_days", 365)
    check.need(_is_int_in(validity, 1, 3650), "validity_days",
               f"must be a whole number of days in [1, 3650], got {validity!r}")
    sites = _parse_sites(raw.get("sites"), check)
    people = _parse_scientists(raw.get("scientists", []), check)
    names = [s.name.casefold() for s in sites] + [p.name.casefold() for p in people] + ["coordinator"]
    for dup in sorted({n for n in names if names.count(n) > 1}):   # unique whatever the case (a log reader's view)
        check.add("sites/scientists", f"the name {dup!r} is used twice, in any case (or is 'coordinator'); "
                                      f"every participant needs its own identity")
    if check.found:
        raise check.found[0] if len(check.found) == 1 else ConfigErrors(check.found)
    return Project(name=str(name), host=server.host, sans=server.sans, listen=server.listen,
                   metrics_addr=server.metrics_addr, aggregator_metrics_port=server.aggregator_metrics_port,
                   coordinator_metrics_port=server.coordinator_metrics_port,
                   coordinator_port=server.coordinator_port, aggregator_port=server.aggregator_port,
                   broker_port=server.broker_port, broker_management_port=server.broker_management_port,
                   broker_metrics_port=server.broker_metrics_port, broker_dist_port=server.broker_dist_port,
                   namespace=server.namespace, validity_days=int(validity),
                   sites=tuple(sites), scientists=tuple(people))


def _parse_server(server: object, check: _Problems) -> _Server:
    """The `server` section: where the sites reach the server, and what it binds."""
    if not isinstance(server, Mapping):
        check.add("server", "must be a mapping")
        server = {}
    check.known_keys(server, "server.", _SERVER_KEYS)
    host = server.get("host")
    check.need(isinstance(host, str) and _is_host(host), "server.host",
               "must be the DNS name or IP address the sites reach the server by")
    sans = server.get("sans", [])
    if check.need(isinstance(sans, list) and all(isinstance(s, str) for s in sans), "server.sans",
                  "must be a list of DNS names or IP addresses"):
        for i, s in enumerate(sans):
            check.need(_is_host(s), f"server.sans[{i}]", f"not a DNS name or IP address: {s!r}")
    ports = {}
    for key, default in (("coordinator_port", 50052), ("aggregator_port", 50051), ("broker_port", 5671),
                         ("broker_management_port", 15672), ("broker_metrics_port", 15692),
                         ("broker_dist_port", 25671)):
        value = server.get(key, default)
        check.need(_is_int_in(value, 1, 65535), f"server.{key}", f"must be a port in [1, 65535], got {value!r}")
        ports[key] = value
    for key, default in _METRICS_PORTS:
        value = server.get(key, default)
        check.need(_is_int_in(value, 0, 65535), f"server.{key}", f"must be a port in [0, 65535] (0: none), got {value!r}")
        ports[key] = value
    listen = server.get("listen", "0.0.0.0")
    check.need(isinstance(listen, str) and _is_host(listen), "server.listen", "must be an address to bind")
    metrics_addr = server.get("metrics_addr", "127.0.0.1")
    check.need(isinstance(metrics_addr, str) and _is_host(metrics_addr), "server.metrics_addr",
               "must be an address to bind (127.0.0.1: this host only)")
    namespace = server.get("namespace", "fedbroker")
    check.need(_is_name(namespace), "server.namespace", _NAME_RULE)
    return _Server(host=str(host), sans=tuple(sans) if isinstance(sans, list) else (), listen=str(listen),
                   metrics_addr=str(metrics_addr), namespace=str(namespace), **ports)


def _parse_sites(raw_sites: object, check: _Problems) -> list[Site]:
    """The data owners; each one's worker settings loaded as its worker will load them."""
    sites: list[Site] = []
    for where, s in check.entries(raw_sites, "sites", "must list at least one data-owner site", allow_empty=False):
        check.known_keys(s, f"{where}.", _SITE_KEYS)
        sname = s.get("name")
        check.need(_is_name(sname), f"{where}.name", f"{_NAME_RULE} (it is the worker's id)")
        cats = s.get("categories", ["digits"])
        check.need(isinstance(cats, list) and bool(cats) and all(isinstance(c, str) for c in cats),
                   f"{where}.categories", "must be a non-empty list of data categories")
        worker = s.get("worker", {})
        if check.need(isinstance(worker, Mapping), f"{where}.worker", "must be a mapping of worker settings"):
            for key in ("id", "categories"):
                check.need(key not in worker, f"{where}.worker.{key}", f"is set by the kit: use {where}.name/categories")
            if "id" not in worker and "categories" not in worker:
                check.found += config_problems(where, {"worker": dict(worker)}, site=str(sname))
        sites.append(Site(str(sname), tuple(str(c) for c in cats) if isinstance(cats, list) else (),
                          dict(worker) if isinstance(worker, Mapping) else {}))
    return sites


def _parse_scientists(raw_people: object, check: _Problems) -> list[Person]:
    """The data scientists and their roles."""
    people: list[Person] = []
    for where, p in check.entries(raw_people, "scientists", "must be a list", allow_empty=True):
        pname, role = p.get("name"), p.get("role", ROLE_SUBMITTER)
        check.need(_is_name(pname), f"{where}.name", _NAME_RULE)
        check.need(role in (ROLE_SUBMITTER, ROLE_VIEWER), f"{where}.role",
                   f"must be {ROLE_SUBMITTER} or {ROLE_VIEWER}, got {role!r}")
        people.append(Person(str(pname), str(role)))
    return people


def config_problems(where: str, doc: Mapping[str, Any], *, site: str = "") -> list[ConfigError]:
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


def _is_name(value: object) -> bool:
    return isinstance(value, str) and bool(_NAME.fullmatch(value))


def _is_int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return len(text) <= 253 and bool(_HOST.fullmatch(text))
