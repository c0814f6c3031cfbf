"""What `fedbroker provision` issued, kept beside the kits (DIR/provision-state.json), so a later command adds,
renews, revokes or rotates one participant under the same CA instead of reissuing everything.

The record holds, per participant: its kind (server, site, scientist), role, kit folder, broker user, every
certificate ever issued to it (serial, validity, current / superseded / revoked), the SHA-256 digests of the
tokens the services accept for it (never a token), and whether it is revoked (when, why). It holds no secret:
the CA's key stays in DIR/ca, tokens and broker passwords only in their kits. It is written whole (a new file
renamed over the old one), after the kits it describes, so a command that fails half-way is run again.
"""

from __future__ import annotations

import datetime
import enum
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509

from fedbroker.app.provision.folder import replace_file
from fedbroker.app.provision.project import Person, Project, Site
from fedbroker.errors import ConfigError

STATE_FILE = "provision-state.json"
FORMAT = "fedbroker-provision-state"
VERSION = 1
SERVER = "coordinator"                   # the server kit's own identity (its client certificate's CN)
_HEX64 = re.compile(r"[0-9a-f]{64}")


class Kind(enum.StrEnum):
    """Who a participant is: the server (its own client identity), a site, or a scientist (a person's kit)."""

    SERVER = "server"
    SITE = "site"
    SCIENTIST = "scientist"


class Standing(enum.StrEnum):
    """A participant's standing: active until revoked (a revoked name is never issued again)."""

    ACTIVE = "active"
    REVOKED = "revoked"


class CertificateStatus(enum.StrEnum):
    """A certificate's: current (its kit holds it), superseded (renewed), or revoked (in the CRL)."""

    CURRENT = "current"
    SUPERSEDED = "superseded"
    REVOKED = "revoked"


def now() -> str:
    """This moment in UTC, as every time in the record is written (ISO 8601)."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclass
class Certificate:
    """One certificate issued to a participant. `file` is relative to DIR; `serial` is hex (as openssl prints it)."""

    file: str
    serial: str
    not_before: str
    not_after: str
    status: CertificateStatus = CertificateStatus.CURRENT
    revoked_at: str | None = None
    revoked_reason: str | None = None    # an RFC 5280 reason (cryptography's x509.ReasonFlags name)

    @classmethod
    def of(cls, out: Path, file: str) -> Certificate:
        """The record of the certificate at DIR/`file`, read from the certificate itself."""
        cert = x509.load_pem_x509_certificate((out / file).read_bytes())
        return cls(file=file, serial=format(cert.serial_number, "X"),
                   not_before=cert.not_valid_before_utc.isoformat(), not_after=cert.not_valid_after_utc.isoformat())


@dataclass
class Participant:
    """One identity of the project: who it is, where its kit is, and what the services accept from it."""

    name: str
    kind: Kind
    role: str                            # its token tables' role (fedbroker.rpc.auth)
    kit: str                             # its kit folder, relative to DIR
    broker_user: str | None              # its RabbitMQ user (a scientist has none)
    tokens_sha256: list[str]             # the digests the token tables accept for it: two while rotating
    certificates: list[Certificate]
    site: dict[str, Any] | None = None   # a site's categories and worker settings, as in project.yaml
    rotating_from: list[str] = field(default_factory=list)   # the digests `rotate-token --finish` retires
    status: Standing = Standing.ACTIVE
    revoked_at: str | None = None
    revoked_reason: str | None = None

    def current(self) -> list[Certificate]:
        """Its certificates in force (what its kit holds now)."""
        return [c for c in self.certificates if c.status is CertificateStatus.CURRENT]


@dataclass
class State:
    """The whole record: the project's settings, its participants by name, the CRL's number, and a log."""

    project: dict[str, Any]              # name, server section, validity_days (no participants: they are below)
    participants: dict[str, Participant]
    ca: list[Certificate] = field(default_factory=list)   # the CA's certificates (renewed: same key, same name)
    crl_number: int = 0
    log: list[dict[str, str]] = field(default_factory=list)

    def note(self, action: str, name: str, detail: str = "") -> None:
        """One line of the log: what was done to whom, and when."""
        self.log.append({"at": now(), "action": action, "name": name, **({"detail": detail} if detail else {})})

    def get(self, name: str) -> Participant:
        """The participant `name`; an unknown name is an error that lists the known ones."""
        if name not in self.participants:
            raise ConfigError("--name", f"no participant {name!r} in this project; it has: "
                                        f"{', '.join(sorted(self.participants))}")
        return self.participants[name]

    def active(self, kind: Kind) -> list[Participant]:
        """The participants of `kind` that are not revoked, in the order they were issued."""
        return [p for p in self.participants.values() if p.kind is kind and p.status is Standing.ACTIVE]

    def to_project(self) -> Project:
        """The project as the kits render it now: its settings and its active sites and scientists."""
        server = self.project["server"]
        return Project(name=self.project["name"], host=server["host"], sans=tuple(server["sans"]),
                       listen=server["listen"], metrics_addr=server["metrics_addr"],
                       coordinator_port=server["coordinator_port"], aggregator_port=server["aggregator_port"],
                       broker_port=server["broker_port"], namespace=server["namespace"],
                       broker_management_port=server.get("broker_management_port", 15672),
                       broker_metrics_port=server.get("broker_metrics_port", 15692),
                       broker_dist_port=server.get("broker_dist_port", 25671),
                       coordinator_metrics_port=server["coordinator_metrics_port"],
                       aggregator_metrics_port=server["aggregator_metrics_port"],
                       validity_days=self.project["validity_days"],
                       sites=tuple(Site(p.name, tuple((p.site or {}).get("categories", [])),
                                        dict((p.site or {}).get("worker", {}))) for p in self.active(Kind.SITE)),
                       scientists=tuple(Person(p.name, p.role) for p in self.active(Kind.SCIENTIST)))

    def project_doc(self) -> dict[str, Any]:
        """project.yaml as it would read with every participant ever issued (revoked ones too: a name is never
        reused), for checking a new one against the others."""
        return {**self.project,
                "sites": [{"name": p.name, **(p.site or {})} for p in self.participants.values()
                          if p.kind is Kind.SITE],
                "scientists": [{"name": p.name, "role": p.role} for p in self.participants.values()
                               if p.kind is Kind.SCIENTIST]}


def settings_doc(project: Project) -> dict[str, Any]:
    """The project's own settings (no participants), as project.yaml writes them."""
    return {"name": project.name, "validity_days": project.validity_days,
            "server": {"host": project.host, "sans": list(project.sans), "listen": project.listen,
                       "metrics_addr": project.metrics_addr, "coordinator_port": project.coordinator_port,
                       "aggregator_port": project.aggregator_port, "broker_port": project.broker_port,
                       "namespace": project.namespace, "coordinator_metrics_port": project.coordinator_metrics_port,
                       "aggregator_metrics_port": project.aggregator_metrics_port,
                       "broker_management_port": project.broker_management_port,
                       "broker_metrics_port": project.broker_metrics_port,
                       "broker_dist_port": project.broker_dist_port}}


def site_doc(site: Site) -> dict[str, Any]:
    """A site's entry of project.yaml, without its name."""
    return {"categories": list(site.categories), "worker": dict(site.worker)}


def save(out: Path, state: State) -> None:
    """Write the record whole (owner-only: it names every participant and its certificates)."""
    for p in state.participants.values():
        for digest in p.tokens_sha256 + p.rotating_from:
            if not _HEX64.fullmatch(digest):  # a plain token must never reach this file
                raise ValueError(f"refusing to record {p.name!r}'s token: the record keeps SHA-256 digests only")
    doc = {"format": FORMAT, "version": VERSION, "project": state.project,
           "ca": [asdict(c) for c in state.ca], "crl_number": state.crl_number,
           "participants": [asdict(p) for p in state.participants.values()], "log": state.log}
    replace_file(out / STATE_FILE, json.dumps(doc, indent=2, sort_keys=False) + "\n", secret=True)


def load(out: Path) -> State:
    """The record `fedbroker provision` wrote into DIR; a folder without one (or with a broken one) is refused
    naming the file."""
    path = out / STATE_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("--out", f"{out} holds no {STATE_FILE}: give the folder `fedbroker provision project.yaml "
                                   f"--out DIR` wrote (kits provisioned before this record existed cannot be "
                                   f"extended: provision the project again)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(str(path), f"cannot be read as the provisioning record: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(str(path), f"is not a provisioning record (no \"format\": \"{FORMAT}\")")
    if raw.get("version") != VERSION:
        raise ConfigError(str(path), f"is version {raw.get('version')!r}; this fedbroker reads version {VERSION}")
    try:
        participants = {}
        for p in raw["participants"]:
            participant = _participant(p)
            participants[participant.name] = participant
        record = State(project=dict(raw["project"]), participants=participants,
                       ca=[_certificate(c) for c in raw["ca"]], crl_number=int(raw["crl_number"]),
                       log=list(raw.get("log", [])))
        record.to_project()   # every setting the kits are rendered from is there
        return record
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(str(path), f"is damaged: {exc!r}") from None


def _participant(doc: dict[str, Any]) -> Participant:
    """One participant as the record holds it, its kind and statuses read into their enums (an unknown one is
    damage, named)."""
    if doc.get("kind") not in set(Kind):
        raise ValueError(f"participant {doc.get('name')!r} has an unknown kind {doc.get('kind')!r}")
    certificates = [_certificate(c) for c in doc.pop("certificates")]
    return Participant(**{**doc, "kind": Kind(doc["kind"]), "status": Standing(doc.get("status", Standing.ACTIVE))},
                       certificates=certificates)


def _certificate(doc: dict[str, Any]) -> Certificate:
    """One certificate as the record holds it, its status read into the enum."""
    return Certificate(**{**doc, "status": CertificateStatus(doc.get("status", CertificateStatus.CURRENT))})
