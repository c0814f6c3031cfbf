"""A provisioned project's later life, under the same CA, from the record `provision` kept (`state`): add a
site or a scientist, renew certificates, revoke a participant, rotate a token in two steps.

Each command changes only what it must: a new kit, the server kit's tables, broker users and CRL (each file
written whole, `serverkit`), and the record, written last. The kits already handed out keep working unchanged,
except the revoked participant's (and, after `renew`, the renewed ones get new certificates to hand out).
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography import x509

from fedbroker.app.provision import serverkit, state
from fedbroker.app.provision.authority import Authority, Revoked
from fedbroker.app.provision.configs import broker_user, kit_config_problems
from fedbroker.app.provision.folder import replace_file
from fedbroker.app.provision.kits import (
    SERVER_ROLES,
    kit_folder,
    participant,
    scientist_kit,
    server_certificate,
    site_kit,
)
from fedbroker.app.provision.project import Project, parse_project
from fedbroker.app.provision.state import (
    SERVER,
    Certificate,
    CertificateStatus,
    Kind,
    Participant,
    Standing,
    State,
)
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.rpc.auth import ROLE_WORKER, generate_token, hash_token

REASONS = tuple(r.name for r in x509.ReasonFlags if r.name not in ("remove_from_crl", "certificate_hold"))


class Opened:
    """One provisioned folder, opened for a change: its record, the project as the kits render it, its CA. Used
    as a context, it holds the folder for itself: a second command on the same folder is refused until the
    first is done, so neither loses the other's change to the record."""

    record: State
    project: Project
    ca: Authority

    def __init__(self, out: str | Path) -> None:
        self.root = Path(out)
        self.server = self.root / "server"
        self._lock = -1

    def __enter__(self) -> Opened:
        state.load(self.root)   # a folder without a record is refused by name before anything else
        self._lock = os.open(self.root, os.O_RDONLY)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.record = state.load(self.root)   # as the command before this one left it
            self.project = self.record.to_project()
            self.ca = Authority.load(self.root / "ca", self.project.validity_days)
        except BlockingIOError:
            os.close(self._lock)
            raise ConfigError("--out", f"another `fedbroker provision` is changing {self.root} now: "
                                       f"run this one when it is done") from None
        except BaseException:
            os.close(self._lock)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._lock)   # closing the folder's descriptor releases the lock

    def save(self) -> None:
        """The CRL signed again (a fresh next update, the revoked serials), then the record: always last."""
        self.record.crl_number += 1
        revoked = [Revoked(int(c.serial, 16), datetime.datetime.fromisoformat(c.revoked_at or state.now()),
                           x509.ReasonFlags[c.revoked_reason or "unspecified"])
                   for p in self.record.participants.values() for c in p.certificates
                   if c.status is CertificateStatus.REVOKED]
        serverkit.write_crl(self.server, self.ca.crl(revoked, number=self.record.crl_number,
                                                     next_update_days=self.project.validity_days))
        state.save(self.root, self.record)

    def active(self, name: str) -> Participant:
        """`name`'s record, refused if it is revoked (a revoked identity gets nothing new)."""
        who = self.record.get(name)
        if who.status is Standing.REVOKED:
            raise ConfigError("--name", f"{name!r} was revoked ({who.revoked_at}): it gets nothing new; add a new "
                                        f"participant under another name")
        return who

    def write_token(self, who: Participant, token: str) -> None:
        """A participant's token into its own kit (and, for the server, where Kubernetes reads it too)."""
        if who.kind is Kind.SERVER:
            serverkit.set_coordinator_token(self.server, token)
        else:
            replace_file(self.root / who.kit / "secrets/token", token + "\n", secret=True)

    def publish_tokens(self, who: Participant) -> None:
        """Its digests (none once revoked) into the server's token tables."""
        digests = who.tokens_sha256 if who.status is Standing.ACTIVE else []
        serverkit.set_tokens(self.server, kind=who.kind, name=who.name, role=who.role, digests=digests)


# ----- add ---------------------------------------------------------------------------------------


def add(out: str | Path, *, site: Mapping[str, Any] | None = None, scientist: Mapping[str, Any] | None = None) -> Path:
    """Issue one new kit (a site's or a scientist's, entries as in project.yaml) under the project's CA, and let
    the server accept it: its token in the tables, a site's broker user and its place in the coordinator's map
    of broker users. Returns the new kit's folder."""
    if (site is None) == (scientist is None):
        raise ConfigError("add", "give one of --site or --scientist")
    with Opened(out) as opened:
        return _add(opened, dict(site or scientist or {}), Kind.SITE if site else Kind.SCIENTIST)


def _add(opened: Opened, entry: dict[str, Any], kind: Kind) -> Path:
    name = entry.get("name")
    # case-insensitively: a broker user, a certificate's CN or a token identity that differs only in case
    # (HOSPITAL-B after hospital-b was revoked) is the same participant to a person reading a log
    same = [n for n in opened.record.participants if isinstance(name, str) and n.casefold() == name.casefold()]
    if same:
        known = opened.record.participants[same[0]]
        as_ = "" if same[0] == name else f" as {same[0]!r}"
        raise ConfigError(f"--{kind}", f"{name!r} was issued already{as_} ({known.kind}, {known.status}): a name is "
                                       f"never reused, whatever its case")
    doc = opened.record.project_doc()
    doc[f"{kind}s"].append(entry)
    parsed = parse_project(doc)   # the name's rule, its uniqueness, and a site's worker settings as it loads them
    project = dataclasses.replace(opened.project, sites=(*opened.project.sites, parsed.sites[-1])) \
        if kind is Kind.SITE else dataclasses.replace(opened.project, scientists=(*opened.project.scientists,
                                                                               parsed.scientists[-1]))
    problems = kit_config_problems(project)
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    folder = opened.root / kit_folder(kind, str(name))
    if folder.exists():
        raise ConfigError("--out", f"{folder} exists already: move it away, a kit is never written over")
    token, password = generate_token(), secrets.token_urlsafe(24)
    try:
        if kind is Kind.SITE:
            site_kit(project, folder, opened.ca, parsed.sites[-1], token, password)
            who = participant(opened.root, kind=kind, name=str(name), role=ROLE_WORKER, token=token,
                              broker=broker_user(project, str(name)), site=state.site_doc(parsed.sites[-1]))
            serverkit.set_broker_user(opened.server, project, who.name, password)
            serverkit.set_worker_broker_users(opened.server, project)
        else:
            scientist_kit(project, folder, opened.ca, str(name), token)
            who = participant(opened.root, kind=kind, name=str(name), role=parsed.scientists[-1].role, token=token)
        opened.record.participants[who.name] = who
        opened.publish_tokens(who)
        opened.record.note("add", who.name, kind)
        opened.save()
    except BaseException:
        # no kit without its record: the same `add` again writes it anew (and its server entries over any
        # this one left, which name a token and a password no kit holds)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


# ----- renew -------------------------------------------------------------------------------------


def renew(out: str | Path, *, name: str | None = None, new_tokens: bool = False, revoke_old: bool = False,
          days: int | None = None) -> list[Participant]:
    """New certificates (with new keys) for every active participant, or `name` only, valid `days` (default:
    the project's validity_days) from now; the CA's own certificate too when all are renewed (same key and
    name, so every certificate it signed still verifies). Tokens stay unless `new_tokens`; the old
    certificates stay valid until they expire unless `revoke_old` (then the CRL lists them). Returns the
    renewed participants."""
    if days is not None and not 1 <= days <= 3650:
        raise ConfigError("--days", f"must be a whole number of days in [1, 3650], got {days}")
    with Opened(out) as opened:
        if days is not None:
            opened.ca.days = days
        return _renew(opened, name=name, new_tokens=new_tokens, revoke_old=revoke_old)


def _renew(opened: Opened, *, name: str | None, new_tokens: bool, revoke_old: bool) -> list[Participant]:
    targets = [opened.active(name)] if name else [p for p in opened.record.participants.values()
                                                   if p.status is Standing.ACTIVE]
    if name is None:
        _renew_ca(opened)
    for who in targets:
        _reissue(opened, who, revoke_old=revoke_old)
        if new_tokens:
            token = generate_token()
            who.tokens_sha256, who.rotating_from = [hash_token(token)], []
            opened.publish_tokens(who)
            opened.write_token(who, token)
        opened.record.note("renew", who.name, "new keys" + (", new token" if new_tokens else "")
                           + (", old certificates revoked" if revoke_old else ""))
    opened.save()
    return targets


def _renew_ca(opened: Opened) -> None:
    """The CA's certificate renewed, written to DIR/ca and every active kit (each kit verifies the others with it)."""
    opened.ca = opened.ca.renewed()
    pem = opened.ca.cert_pem()
    replace_file(opened.root / "ca/ca.crt", pem, secret=False)
    for who in opened.record.participants.values():
        if who.status is Standing.ACTIVE:
            replace_file(opened.root / who.kit / "ca.crt", pem, secret=False)
    for old in opened.record.ca:
        old.status = CertificateStatus.SUPERSEDED
    opened.record.ca.append(Certificate.of(opened.root, "ca/ca.crt"))
    opened.record.note("renew", "ca", "the CA's certificate: same key, new validity")


def _reissue(opened: Opened, who: Participant, *, revoke_old: bool) -> None:
    """Each certificate of `who`'s kit issued again with a new key; the old ones superseded (or revoked)."""
    kit = opened.root / who.kit
    for old in who.current():
        old.status = CertificateStatus.REVOKED if revoke_old else CertificateStatus.SUPERSEDED
        if revoke_old:
            old.revoked_at, old.revoked_reason = state.now(), "superseded"
    if who.kind is Kind.SERVER:
        pairs = [("tls/coordinator-client", opened.ca.client(SERVER))]
        pairs += [(f"tls/{role}", server_certificate(opened.project, opened.ca, role)) for role in SERVER_ROLES]
    else:
        pairs = [("tls/client", opened.ca.client(who.name))]
    for stem, (cert, key) in pairs:
        replace_file(kit / f"{stem}.key", key, secret=True)
        replace_file(kit / f"{stem}.crt", cert, secret=False)
        who.certificates.append(Certificate.of(opened.root, f"{who.kit}/{stem}.crt"))


# ----- revoke ------------------------------------------------------------------------------------


def revoke(out: str | Path, *, name: str, reason: str = "unspecified") -> tuple[Participant, bool]:
    """Revoke `name`: its certificates into the CA's CRL (server kit's crl.pem), its token out of the tables,
    its broker user out of the broker's definitions and the coordinator's map. Revoking again changes nothing
    but makes sure all of that holds. Returns (the participant, whether it was revoked before)."""
    if reason not in REASONS:
        raise ConfigError("--reason", f"must be one of {', '.join(REASONS)}, got {reason!r}")
    with Opened(out) as opened:
        return _revoke(opened, name=name, reason=reason)


def _revoke(opened: Opened, *, name: str, reason: str) -> tuple[Participant, bool]:
    who = opened.record.get(name)
    if who.kind is Kind.SERVER:
        raise ConfigError("--name", f"{name!r} is the server's own identity: revoking it stops the federation; "
                                    f"renew it (`fedbroker provision renew --name {name}`) or provision anew")
    before = who.status is Standing.REVOKED
    if not before:
        who.status, who.revoked_at, who.revoked_reason = Standing.REVOKED, state.now(), reason
        for cert in who.certificates:
            if cert.status is not CertificateStatus.REVOKED:
                cert.status, cert.revoked_at, cert.revoked_reason = CertificateStatus.REVOKED, who.revoked_at, reason
        who.rotating_from = []
        opened.record.note("revoke", name, reason)
    opened.project = opened.record.to_project()
    opened.publish_tokens(who)
    if who.broker_user:
        serverkit.set_broker_user(opened.server, opened.project, who.name, None)
        serverkit.set_worker_broker_users(opened.server, opened.project)
    opened.save()
    return who, before


# ----- rotate-token ------------------------------------------------------------------------------


def rotate_token(out: str | Path, *, name: str, finish: bool = False) -> Participant:
    """Step 1: a new token into `name`'s kit, its digest added to the tables beside the old one (both work).
    Step 2 (`finish`), once the participant runs with the new token: the old digest out of the tables."""
    with Opened(out) as opened:
        return _rotate(opened, name=name, finish=finish)


def _rotate(opened: Opened, *, name: str, finish: bool) -> Participant:
    who = opened.active(name)
    if finish:
        if not who.rotating_from:
            raise ConfigError("--finish", f"no token rotation of {name!r} is under way: start one with "
                                          f"`fedbroker provision rotate-token --name {name}`")
        who.tokens_sha256 = [d for d in who.tokens_sha256 if d not in who.rotating_from]
        who.rotating_from = []
        opened.publish_tokens(who)
        opened.record.note("rotate-token", name, "finished: the old token is refused")
    else:
        if who.rotating_from:
            raise ConfigError("--name", f"a token rotation of {name!r} is under way: finish it first "
                                        f"(`fedbroker provision rotate-token --name {name} --finish`)")
        token = generate_token()
        who.rotating_from = list(who.tokens_sha256)
        who.tokens_sha256 = [*who.tokens_sha256, hash_token(token)]
        opened.publish_tokens(who)       # the services accept the new token before its kit holds it
        opened.write_token(who, token)
        opened.record.note("rotate-token", name, "started: old and new tokens both accepted")
    opened.save()
    return who


def summary(out: str | Path) -> State:
    """The record, for `fedbroker provision show`."""
    return state.load(Path(out))

