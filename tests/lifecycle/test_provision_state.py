"""`fedbroker provision` keeps a record of what it issued, and later adds a site or scientist, renews certificates,
revokes a participant and rotates a token under the same CA, changing the server kit's files in place (each
whole) and leaving every other kit as it was."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from fedbroker.app.cli import main
from fedbroker.app.provision import folder, lifecycle, parse_project, provision, serverkit, state
from fedbroker.config import load_config
from fedbroker.errors import ConfigError
from fedbroker.rpc.auth import TokenTable, hash_token

PROJECT = {
    "name": "study",
    "server": {"host": "fl.example.org"},
    "sites": [{"name": "hospital-a", "worker": {"dataset": "digits", "dp": {"enabled": False}}},
              {"name": "hospital-b", "categories": ["digits", "scans"]}],
    "scientists": [{"name": "alice"}, {"name": "carol", "role": "viewer"}],
}


@pytest.fixture
def kits(tmp_path: Path) -> Path:
    out = tmp_path / "kits"
    provision(parse_project(PROJECT), out)
    return out


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def token(kits: Path, kit: str) -> str:
    name = "secrets/coordinator.token" if kit == "server" else "secrets/token"
    return (kits / kit / name).read_text().strip()


def table(kits: Path, service: str) -> TokenTable:
    return TokenTable.from_file(str(kits / "server" / serverkit.TABLES[service]))


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def ca_of(kits: Path) -> x509.Certificate:
    return cert(kits / "ca/ca.crt")


def crl_of(kits: Path) -> x509.CertificateRevocationList:
    return x509.load_pem_x509_crl((kits / "server/crl.pem").read_bytes())


def definitions(kits: Path) -> dict:
    return json.loads((kits / "server/rabbitmq/definitions.json").read_text())


def broker_users_map(kits: Path, config: str = "coordinator.yaml") -> dict:
    return yaml.safe_load((kits / "server" / config).read_text())["coordinator"]["worker_broker_users"]


# ----- the record ------------------------------------------------------------------------------------


def test_the_record_lists_every_participant_with_its_certificates_and_token_digests_only(kits):
    path = kits / state.STATE_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    record = state.load(kits)
    assert {n: (p.kind, p.role, p.kit, p.broker_user) for n, p in record.participants.items()} == {
        "coordinator": ("server", "coordinator", "server", "study-coordinator"),
        "hospital-a": ("site", "worker", "sites/hospital-a", "study-hospital-a"),
        "hospital-b": ("site", "worker", "sites/hospital-b", "study-hospital-b"),
        "alice": ("scientist", "submitter", "scientists/alice", None),
        "carol": ("scientist", "viewer", "scientists/carol", None),
    }
    text = path.read_text()
    for who in record.participants.values():
        plain = token(kits, who.kit)
        assert who.tokens_sha256 == [hash_token(plain)]
        assert plain not in text
        for entry in who.current():
            issued = cert(kits / entry.file)
            assert entry.serial == format(issued.serial_number, "X")
            assert entry.not_after == issued.not_valid_after_utc.isoformat()
    assert [c.file for c in record.participants["coordinator"].current()] == [
        "server/tls/coordinator-client.crt", "server/tls/coordinator.crt", "server/tls/aggregator.crt",
        "server/tls/broker.crt"]
    assert record.participants["hospital-b"].site == {"categories": ["digits", "scans"], "worker": {}}
    # broker passwords stay in their kits too
    password = (kits / "sites/hospital-a/secrets/broker-url").read_text().split(":")[2].split("@")[0]
    assert password not in text
    # an empty CRL from the start, signed by the CA, beside the server kit's ca.crt
    crl = crl_of(kits)
    assert crl.is_signature_valid(ca_of(kits).public_key()) and len(crl) == 0


def test_the_record_refuses_to_hold_a_plain_token(kits):
    record = state.load(kits)
    record.participants["alice"].tokens_sha256 = [token(kits, "scientists/alice")]
    before = (kits / state.STATE_FILE).read_bytes()
    with pytest.raises(ValueError, match="SHA-256 digests only"):
        state.save(kits, record)
    assert (kits / state.STATE_FILE).read_bytes() == before


def test_a_folder_without_a_record_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="holds no provision-state.json"):
        lifecycle.add(tmp_path, scientist={"name": "bob"})


@pytest.mark.parametrize("damage, message", [
    (lambda doc: doc["project"]["server"].pop("host"), "is damaged: KeyError\\('host'\\)"),
    (lambda doc: doc.update(version=99), "is version 99"),
    (lambda doc: doc.update(format="other"), "is not a provisioning record"),
    (lambda doc: doc["participants"][1].update(kind="robot"), "is damaged: .*has an unknown kind 'robot'"),
    (lambda doc: doc["participants"][1].update(status="paused"), "is damaged: .*'paused' is not a valid Standing"),
    (lambda doc: doc["ca"][0].update(status="lost"), "is damaged: .*'lost' is not a valid CertificateStatus"),
])
def test_a_damaged_record_is_refused_naming_the_file_and_nothing_changes(kits, damage, message):
    path = kits / state.STATE_FILE
    doc = json.loads(path.read_text())
    damage(doc)
    path.write_text(json.dumps(doc))
    before = snapshot(kits)
    with pytest.raises(ConfigError, match=f"provision-state.json: {message}"):
        lifecycle.revoke(kits, name="alice")
    assert snapshot(kits) == before


def test_the_record_reads_its_kinds_and_statuses_as_enums_and_writes_them_back_unchanged(kits):
    lifecycle.revoke(kits, name="alice")
    path = kits / state.STATE_FILE
    written = path.read_bytes()
    record = state.load(kits)
    alice, site = record.participants["alice"], record.participants["hospital-a"]
    assert (alice.kind, alice.status) == (state.Kind.SCIENTIST, state.Standing.REVOKED)
    assert alice.kind is state.Kind.SCIENTIST and alice.status is state.Standing.REVOKED
    assert all(c.status is state.CertificateStatus.REVOKED for c in alice.certificates)
    assert site.kind is state.Kind.SITE and site.status is state.Standing.ACTIVE and site.current()
    assert [p.name for p in record.active(state.Kind.SCIENTIST)] == ["carol"]
    state.save(kits, record)
    assert path.read_bytes() == written   # the file holds the same strings it always did
    assert json.loads(written)["participants"][0]["kind"] == "server"


# ----- add -------------------------------------------------------------------------------------------


def test_an_added_site_gets_a_kit_under_the_same_ca_and_the_server_accepts_it(kits):
    others = {k: snapshot(kits / k) for k in ("sites/hospital-a", "sites/hospital-b", "scientists/alice",
                                              "scientists/carol", "ca")}
    old_tokens = {k: token(kits, k) for k in ("server", "sites/hospital-a", "scientists/alice")}
    (kits / "w.yaml").write_text("dataset: wine\ndp: {epsilon_budget: 4}\n")
    assert main(["provision", "add", "--out", str(kits), "--site", "hospital-c", "--category", "wine",
                 "--worker", str(kits / "w.yaml")]) == 0
    new = kits / "sites/hospital-c"
    issued = cert(new / "tls/client.crt")
    issued.verify_directly_issued_by(ca_of(kits))
    assert issued.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "hospital-c"
    assert (new / "ca.crt").read_bytes() == (kits / "ca/ca.crt").read_bytes()
    assert {k: snapshot(kits / k) for k in others} == others           # every other kit, byte for byte
    worker = load_config(str(new / "worker.yaml"), environ={}).worker
    assert (worker.id, list(worker.categories), worker.dataset) == ("hospital-c", ["wine"], "wine")
    for service in ("aggregator", "coordinator"):
        identity = table(kits, service).identify(token(kits, "sites/hospital-c"))
        assert (identity.name, identity.role) == ("hospital-c", "worker")
    assert table(kits, "aggregator").identify(old_tokens["server"]).name == "coordinator"
    assert table(kits, "coordinator").identify(old_tokens["scientists/alice"]).name == "alice"
    assert "study-hospital-c" in {u["name"] for u in definitions(kits)["users"]}
    permission = next(p for p in definitions(kits)["permissions"] if p["user"] == "study-hospital-c")
    assert "worker\\.hospital\\-c" in permission["read"]
    for config in serverkit.COORDINATOR_CONFIGS:
        assert broker_users_map(kits, config)["study-hospital-c"] == ["hospital-c"]
    # the coordinator's host config still loads, its header kept
    assert (kits / "server/coordinator.yaml").read_text().startswith("# The coordinator (start-coordinator.sh)")
    load_config(str(kits / "server/coordinator.yaml"), environ={})
    record = state.load(kits)
    assert record.participants["hospital-c"].site == {"categories": ["wine"],
                                                      "worker": {"dataset": "wine", "dp": {"epsilon_budget": 4}}}


def test_an_added_viewer_opens_the_coordinator_only(kits):
    lifecycle.add(kits, scientist={"name": "dave", "role": "viewer"})
    dave = token(kits, "scientists/dave")
    assert table(kits, "coordinator").identify(dave).role == "viewer"
    assert table(kits, "aggregator").identify(dave) is None
    assert "study-dave" not in {u["name"] for u in definitions(kits)["users"]}


@pytest.mark.parametrize("site, field", [
    ({"name": "hospital-a"}, "was issued already"),
    ({"name": "bad/name"}, "sites[2].name"),
    ({"name": "hospital-c", "worker": {"datset": "digits"}}, "sites[2].worker.datset"),
])
def test_a_bad_addition_is_refused_naming_it_and_nothing_changes(kits, site, field):
    before = snapshot(kits)
    with pytest.raises(ConfigError) as refused:
        lifecycle.add(kits, site=site)
    assert field in str(refused.value)
    assert snapshot(kits) == before


def test_an_addition_that_fails_half_way_leaves_no_kit_and_no_record_of_it(kits, monkeypatch):
    record = (kits / state.STATE_FILE).read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(serverkit, "set_broker_user", broken)
    with pytest.raises(OSError, match="disk full"):
        lifecycle.add(kits, site={"name": "hospital-c"})
    assert not (kits / "sites/hospital-c").exists()
    assert (kits / state.STATE_FILE).read_bytes() == record
    monkeypatch.undo()
    lifecycle.add(kits, site={"name": "hospital-c"})   # the same addition again, whole this time
    assert table(kits, "aggregator").identify(token(kits, "sites/hospital-c")).name == "hospital-c"


def test_two_commands_on_one_folder_never_run_at_once(kits):
    import fcntl

    held = os.open(kits, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match="another `fedbroker provision` is changing"):
            lifecycle.rotate_token(kits, name="alice")
    finally:
        os.close(held)
    lifecycle.rotate_token(kits, name="alice")


def test_a_revoked_name_is_never_issued_again(kits):
    lifecycle.revoke(kits, name="carol")
    with pytest.raises(ConfigError, match="'carol' was issued already \\(scientist, revoked\\)"):
        lifecycle.add(kits, scientist={"name": "carol"})


def test_a_name_is_unique_whatever_its_case_even_after_a_revocation(kits, capsys):
    """`provision add --site HOSPITAL-B` after hospital-b was revoked: refused naming the existing one (it was
    accepted, a second broker user, certificate and token for what a log reader takes for the same site)."""
    lifecycle.revoke(kits, name="hospital-b")
    before = snapshot(kits)
    assert main(["provision", "add", "--out", str(kits), "--site", "HOSPITAL-B"]) == 2
    err = capsys.readouterr().err
    assert "'HOSPITAL-B' was issued already as 'hospital-b' (site, revoked)" in err, err
    assert snapshot(kits) == before
    with pytest.raises(ConfigError, match="'hospital-a' is used twice, in any case"):
        parse_project({**PROJECT, "sites": [*PROJECT["sites"], {"name": "Hospital-A"}]})


# ----- renew -----------------------------------------------------------------------------------------


def test_renewing_everything_keeps_tokens_and_changes_serials_keys_and_validity(kits):
    old_ca = ca_of(kits)
    old = {f: cert(f) for f in kits.rglob("*.crt") if f.parent.name == "tls"}
    keys = {f: f.read_bytes() for f in kits.rglob("*.key") if f.parent.name == "tls"}
    tokens = {k: snapshot(kits / k / "secrets") for k in ("server", "sites/hospital-a", "scientists/alice")}
    tables = {s: (kits / "server" / t).read_bytes() for s, t in serverkit.TABLES.items()}
    assert main(["provision", "renew", "--out", str(kits)]) == 0
    new_ca = ca_of(kits)
    assert new_ca.public_key() == old_ca.public_key() and new_ca.serial_number != old_ca.serial_number
    assert new_ca.not_valid_after_utc >= old_ca.not_valid_after_utc
    for path, before in old.items():
        after = cert(path)
        assert after.serial_number != before.serial_number, path
        assert after.not_valid_after_utc >= before.not_valid_after_utc
        assert after.not_valid_before_utc >= before.not_valid_before_utc
        assert after.subject == before.subject
        assert [e.value for e in after.extensions] == [e.value for e in before.extensions]   # same names, same use
        after.verify_directly_issued_by(new_ca)
        after.verify_directly_issued_by(old_ca)   # same key: a kit still holding the old ca.crt verifies it
        before.verify_directly_issued_by(new_ca)  # and the old certificates verify under the renewed CA
    assert all(path.read_bytes() != key for path, key in keys.items())   # new keys
    assert {k: snapshot(kits / k / "secrets") for k in tokens} == tokens
    assert {s: (kits / "server" / t).read_bytes() for s, t in serverkit.TABLES.items()} == tables
    record = state.load(kits)
    alice = record.participants["alice"]
    assert [c.status for c in alice.certificates] == ["superseded", "current"]
    assert alice.certificates[0].serial == format(old[kits / "scientists/alice/tls/client.crt"].serial_number, "X")
    assert [c.status for c in record.ca] == ["superseded", "current"]
    assert len(crl_of(kits)) == 0   # renewal revokes nothing unless asked


def test_a_renewal_for_a_shorter_time_gives_every_certificate_and_the_ca_that_validity(kits):
    old = cert(kits / "sites/hospital-a/tls/client.crt")
    assert main(["provision", "renew", "--out", str(kits), "--days", "30"]) == 0
    for path in (kits / "sites/hospital-a/tls/client.crt", kits / "server/tls/broker.crt", kits / "ca/ca.crt"):
        lasts = cert(path).not_valid_after_utc - cert(path).not_valid_before_utc
        assert 29 < lasts.total_seconds() / 86400 < 31, path
    assert cert(kits / "sites/hospital-a/tls/client.crt").not_valid_after_utc < old.not_valid_after_utc
    record = state.load(kits).participants["hospital-a"]
    assert record.certificates[0].not_after == old.not_valid_after_utc.isoformat()
    with pytest.raises(ConfigError, match="--days"):
        lifecycle.renew(kits, days=0)


def test_renewing_one_participant_with_a_new_token_changes_only_its_kit(kits):
    others = {k: snapshot(kits / k) for k in ("sites/hospital-b", "scientists/alice", "server/tls", "ca")}
    old = token(kits, "sites/hospital-a")
    old_serial = cert(kits / "sites/hospital-a/tls/client.crt").serial_number
    lifecycle.renew(kits, name="hospital-a", new_tokens=True, revoke_old=True)
    new = token(kits, "sites/hospital-a")
    assert new != old
    for service in ("aggregator", "coordinator"):
        assert table(kits, service).identify(old) is None
        assert table(kits, service).identify(new).name == "hospital-a"
    assert {k: snapshot(kits / k) for k in others} == others
    revoked = crl_of(kits).get_revoked_certificate_by_serial_number(old_serial)
    assert revoked is not None   # --revoke-old: the replaced certificate is in the CRL
    assert cert(kits / "sites/hospital-a/tls/client.crt").serial_number != old_serial


# ----- revoke ----------------------------------------------------------------------------------------


def test_revoking_a_site_lists_its_serial_in_the_crl_and_drops_its_token_and_broker_user(kits, capsys):
    serial = cert(kits / "sites/hospital-b/tls/client.crt").serial_number
    site_token = token(kits, "sites/hospital-b")
    assert main(["provision", "revoke", "--out", str(kits), "--name", "hospital-b", "--reason",
                 "key_compromise"]) == 0
    server = kits / "server"
    assert (f"fedbroker broker sync {server}/rabbitmq/definitions.json --crl {server}/crl.pem --crl-dir "
            f"{server}/rabbitmq/crls --node fedbroker-study@localhost\n") in capsys.readouterr().out   # the exact
    # command, for the broker's host: the kit's own node (start-broker.sh's), never the host's default one
    crl = crl_of(kits)
    assert crl.is_signature_valid(ca_of(kits).public_key())
    assert crl.issuer == ca_of(kits).subject and crl.next_update_utc > crl.last_update_utc
    entry = crl.get_revoked_certificate_by_serial_number(serial)
    assert entry is not None
    assert entry.extensions.get_extension_for_class(x509.CRLReason).value.reason == x509.ReasonFlags.key_compromise
    for service in ("aggregator", "coordinator"):
        assert table(kits, service).identify(site_token) is None
        assert table(kits, service).identify(token(kits, "sites/hospital-a")).name == "hospital-a"
    assert "study-hospital-b" not in {u["name"] for u in definitions(kits)["users"]}
    assert "study-hospital-b" not in {p["user"] for p in definitions(kits)["permissions"]}
    for config in serverkit.COORDINATOR_CONFIGS:
        assert broker_users_map(kits, config) == {"study-hospital-a": ["hospital-a"]}
    who = state.load(kits).participants["hospital-b"]
    assert (who.status, who.revoked_reason) == ("revoked", "key_compromise")
    assert {c.status for c in who.certificates} == {"revoked"}


def test_apply_broker_that_cannot_reach_the_broker_fails_after_the_kit_changed_and_names_the_line_to_run(kits,
                                                                                                      capsys):
    assert main(["provision", "revoke", "--out", str(kits), "--name", "hospital-b", "--apply-broker",
                 "--rabbitmqctl", "/nonexistent/rabbitmqctl"]) == 1
    out, err = capsys.readouterr()
    assert "fedbroker broker sync " in out and "applying it to the running broker" in out
    assert "/nonexistent/rabbitmqctl not found" in err
    assert state.load(kits).participants["hospital-b"].status == "revoked"   # the kit changed: run the line later
    # the CRL went in first (it needs no rabbitmqctl): the broker's copy in the kit is the kit's CRL
    (copy,) = (kits / "server" / serverkit.CRL_DIR).iterdir()
    assert copy.read_bytes() == (kits / "server" / serverkit.CRL_FILE).read_bytes()


def test_revoking_twice_changes_nothing_more(kits):
    _, before = lifecycle.revoke(kits, name="alice")
    assert not before
    signed = (serverkit.CRL_FILE, serverkit.CRL_DIR)   # the CRL is signed anew (its copy for the broker too)
    files = {k: v for k, v in snapshot(kits / "server").items() if not k.startswith(signed)}
    serials = {r.serial_number for r in crl_of(kits)}
    who, before = lifecycle.revoke(kits, name="alice", reason="superseded")
    assert before and who.revoked_reason == "unspecified"
    assert {k: v for k, v in snapshot(kits / "server").items() if not k.startswith(signed)} == files
    assert {r.serial_number for r in crl_of(kits)} == serials


def test_revoking_an_unknown_name_or_the_server_is_a_clear_error(kits, capsys):
    assert main(["provision", "revoke", "--out", str(kits), "--name", "nobody"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("fedbroker provision: config: --name: no participant 'nobody' in this project; it has: alice, "
                   "carol, coordinator, hospital-a, hospital-b")
    with pytest.raises(ConfigError, match="the server's own identity"):
        lifecycle.revoke(kits, name="coordinator")
    with pytest.raises(ConfigError, match="--reason"):
        lifecycle.revoke(kits, name="alice", reason="bored")
    lifecycle.revoke(kits, name="alice")
    with pytest.raises(ConfigError, match="'alice' was revoked"):
        lifecycle.renew(kits, name="alice")
    with pytest.raises(ConfigError, match="'alice' was revoked"):
        lifecycle.rotate_token(kits, name="alice")


# ----- rotate-token ----------------------------------------------------------------------------------


def test_a_token_rotation_accepts_both_tokens_until_it_is_finished(kits):
    old = token(kits, "sites/hospital-a")
    assert main(["provision", "rotate-token", "--out", str(kits), "--name", "hospital-a"]) == 0
    new = token(kits, "sites/hospital-a")
    assert new != old
    for service in ("aggregator", "coordinator"):
        assert table(kits, service).identify(old).name == table(kits, service).identify(new).name == "hospital-a"
    entry = yaml.safe_load((kits / "server/tokens/aggregator.yaml").read_text())["hospital-a"]
    assert entry == {"role": "worker", "sha256": [hash_token(old), hash_token(new)]}
    with pytest.raises(ConfigError, match="under way: finish it first"):
        lifecycle.rotate_token(kits, name="hospital-a")
    lifecycle.rotate_token(kits, name="hospital-a", finish=True)
    for service in ("aggregator", "coordinator"):
        assert table(kits, service).identify(old) is None
        assert table(kits, service).identify(new).name == "hospital-a"
    assert state.load(kits).participants["hospital-a"].tokens_sha256 == [hash_token(new)]
    with pytest.raises(ConfigError, match="no token rotation of 'hospital-a' is under way"):
        lifecycle.rotate_token(kits, name="hospital-a", finish=True)


def test_rotating_the_coordinators_token_reaches_its_kubernetes_secret_too(kits):
    old = token(kits, "server")
    lifecycle.rotate_token(kits, name="coordinator")
    new = token(kits, "server")
    assert f"FEDBROKER__CLIENT__TOKEN={new}\n" in (kits / "server/k8s/coordinator.env").read_text()
    assert table(kits, "aggregator").identify(old).name == table(kits, "aggregator").identify(new).name
    lifecycle.rotate_token(kits, name="coordinator", finish=True)
    assert table(kits, "aggregator").identify(old) is None


# ----- files changed whole -----------------------------------------------------------------------------


def test_a_token_table_is_replaced_whole_never_rewritten_in_place(kits):
    path = kits / "server/tokens/aggregator.yaml"
    before = path.stat().st_ino
    with open(path, "rb") as reader:  # a service that opened the old table reads it whole, unchanged
        lifecycle.add(kits, site={"name": "hospital-c"})
        old_text = reader.read().decode()
    assert "hospital-c" not in old_text and "hospital-c" in path.read_text()
    assert path.stat().st_ino != before
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]   # no temporary file left


def test_a_failed_replacement_leaves_the_old_file_and_no_temporary(kits, monkeypatch):
    path = kits / "server/tokens/coordinator.yaml"
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        folder.replace_file(path, b"half", secret=True)
    assert path.read_bytes() == before
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_the_first_run_verb_still_takes_the_project_file_first(tmp_path, capsys):
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(PROJECT))
    assert main(["provision", str(tmp_path / "project.yaml"), "--out", str(tmp_path / "a")]) == 0
    assert main(["provision", "new", str(tmp_path / "project.yaml"), "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / state.STATE_FILE).exists() and (tmp_path / "b" / state.STATE_FILE).exists()
    capsys.readouterr()
    assert main(["provision", "show", "--out", str(tmp_path / "a")]) == 0
    shown = capsys.readouterr().out
    assert "hospital-b" in shown and "viewer" in shown
    assert token(tmp_path / "a", "sites/hospital-a") not in shown
