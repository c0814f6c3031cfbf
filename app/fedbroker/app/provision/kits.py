"""Every kit of a project, written whole or not at all: the CA, the server, one per site and one per data
scientist, each holding only what its participant needs."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

from fedbroker.app import unfilled
from fedbroker.app.broker_crl import crl_file_name
from fedbroker.app.provision import k8s, serverkit, state
from fedbroker.app.provision.authority import Authority
from fedbroker.app.provision.configs import (
    CRL_DIR,
    RABBITMQ_PLUGINS,
    aggregator_doc,
    broker_definitions,
    broker_node,
    broker_ssl_config,
    broker_url,
    broker_user,
    coordinator_doc,
    host_rabbitmq_conf,
    kit_config_problems,
    scientist_doc,
    server_scrape_doc,
    site_scrape_doc,
    target,
    worker_doc,
)
from fedbroker.app.provision.folder import KitFolder
from fedbroker.app.provision.project import Project, Site
from fedbroker.app.provision.state import SERVER, Certificate, Kind, Participant, State
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.rpc.auth import ROLE_COORDINATOR, ROLE_WORKER, generate_token, hash_token


def provision(project: Project, out: str | os.PathLike[str]) -> dict[str, Path]:
    """Write every kit under `out` (which must not exist yet, or be empty), and the record of what was issued
    (`state`); the kits' folders by participant."""
    root = Path(out)
    if root.exists() and any(root.iterdir()):
        raise ConfigError("--out", f"{root} is not empty: provision into a new folder (kits are never overwritten)")
    k8s.check_base()
    problems = kit_config_problems(project)
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
    """The CA first (it signs every certificate), then the server's kit and one per participant, then the record."""
    ca = Authority.create(project.name, project.validity_days)
    ca_kit = KitFolder(root / "ca")
    ca_kit.write("ca.crt", ca.cert_pem())
    ca_kit.write("ca.key", ca.key_pem(), secret=True)

    tokens = {"coordinator": generate_token(), **{s.name: generate_token() for s in project.sites},
              **{p.name: generate_token() for p in project.scientists}}
    # one broker user per participant, named for the project too (several projects may share a broker)
    broker_passwords = {"coordinator": secrets.token_urlsafe(24), **{s.name: secrets.token_urlsafe(24)
                                                                      for s in project.sites}}
    kits = {"ca": ca_kit.root, "server": _server_kit(project, root / "server", ca, tokens, broker_passwords)}
    for site in project.sites:
        kits[f"site:{site.name}"] = site_kit(project, root / "sites" / site.name, ca, site, tokens[site.name],
                                             broker_passwords[site.name])
    for person in project.scientists:
        kits[f"scientist:{person.name}"] = scientist_kit(project, root / "scientists" / person.name, ca,
                                                         person.name, tokens[person.name])
    record = State(project=state.settings_doc(project), participants={}, ca=[Certificate.of(root, "ca/ca.crt")])
    record.participants[SERVER] = participant(root, kind=Kind.SERVER, name=SERVER, role=ROLE_COORDINATOR,
                                              token=tokens[SERVER], broker=broker_user(project, SERVER))
    for site in project.sites:
        record.participants[site.name] = participant(root, kind=Kind.SITE, name=site.name, role=ROLE_WORKER,
                                                     token=tokens[site.name], broker=broker_user(project, site.name),
                                                     site=state.site_doc(site))
    for person in project.scientists:
        record.participants[person.name] = participant(root, kind=Kind.SCIENTIST, name=person.name, role=person.role,
                                                       token=tokens[person.name])
    record.crl_number = 1
    record.note("provision", project.name, f"{len(project.sites)} site(s), {len(project.scientists)} scientist(s)")
    state.save(root, record)
    return kits


# the certificates each kind of kit holds, relative to the kit
SERVER_CERTIFICATES = ("tls/coordinator-client.crt", "tls/coordinator.crt", "tls/aggregator.crt", "tls/broker.crt")
CLIENT_CERTIFICATES = ("tls/client.crt",)


def kit_folder(kind: Kind, name: str) -> str:
    """Where a participant's kit lives, relative to DIR."""
    return "server" if kind is Kind.SERVER else f"{kind}s/{name}"


def participant(root: Path, *, kind: Kind, name: str, role: str, token: str, broker: str | None = None,
                site: dict[str, object] | None = None) -> Participant:
    """The record of a participant whose kit was just written under `root`: its certificates read back from
    the kit, its token as a digest only."""
    kit = kit_folder(kind, name)
    files = SERVER_CERTIFICATES if kind is Kind.SERVER else CLIENT_CERTIFICATES
    return Participant(name=name, kind=kind, role=role, kit=kit, broker_user=broker,
                       tokens_sha256=[hash_token(token)], site=site,
                       certificates=[Certificate.of(root, f"{kit}/{f}") for f in files])


def _server_kit(project: Project, folder: Path, ca: Authority, tokens: dict[str, str],
                passwords: dict[str, str]) -> Path:
    """The coordinator's and the aggregation service's kit (and the broker's): server certificates, the token
    tables (digests only), the broker's users, start scripts and the Kubernetes overlay."""
    kit = KitFolder(folder)
    kit.write("ca.crt", ca.cert_pem())
    for role in SERVER_ROLES:
        cert, key = server_certificate(project, ca, role)
        kit.write(f"tls/{role}.crt", cert)
        kit.write(f"tls/{role}.key", key, secret=True)
    cert, key = ca.client("coordinator")  # what the coordinator presents to the aggregation service and the broker
    kit.write("tls/coordinator-client.crt", cert)
    kit.write("tls/coordinator-client.key", key, secret=True)
    aggregator_table = {"coordinator": {"role": ROLE_COORDINATOR, "sha256": hash_token(tokens["coordinator"])},
                        **{s.name: {"role": ROLE_WORKER, "sha256": hash_token(tokens[s.name])} for s in project.sites}}
    # a site's token opens SiteRecord (its own record: `fedbroker ledger`) on the coordinator, and nothing else there
    coordinator_table = {**{p.name: {"role": p.role, "sha256": hash_token(tokens[p.name])} for p in project.scientists},
                         **{s.name: {"role": ROLE_WORKER, "sha256": hash_token(tokens[s.name])} for s in project.sites}}
    kit.yaml("tokens/aggregator.yaml", aggregator_table, header=serverkit.TABLE_NOTE, secret=True)
    kit.yaml("tokens/coordinator.yaml", coordinator_table or {}, header=serverkit.TABLE_NOTE, secret=True)
    # the CA's revocation list, empty until `fedbroker provision revoke`: there from the start, so a service
    # configured to read it never finds it missing
    crl = ca.crl([], number=1, next_update_days=project.validity_days)
    kit.write(serverkit.CRL_FILE, crl)
    # ... and where the broker checks it (advanced.config's crl_cache): it refuses every client without one
    kit.write(f"{CRL_DIR}/{crl_file_name(ca.cert.subject)}", crl)
    kit.write("secrets/coordinator.token", tokens["coordinator"] + "\n", secret=True)
    kit.write("secrets/broker-url",
              broker_url(broker_user(project, "coordinator"), passwords["coordinator"], project.host, project.broker_port) + "\n",
              secret=True)
    kit.yaml("aggregator.yaml", aggregator_doc(project),
             header="# The aggregation service (start-aggregator.sh): gRPC over mutual TLS, every call authenticated.\n")
    kit.yaml("coordinator.yaml", coordinator_doc(project),
             header="# The coordinator (start-coordinator.sh). aggregator.target is the public name: the tasks it sends\n"
                    "# tell the sites' workers where to upload, and each worker only sends its token there.\n")
    kit.write("rabbitmq/definitions.json", json.dumps(broker_definitions(project, passwords), indent=2) + "\n",
              secret=True)
    # on a host (Kubernetes has its own, k8s/rabbitmq.conf): paths relative to the kit, host-only management
    kit.write("rabbitmq/rabbitmq.conf", host_rabbitmq_conf(project))
    kit.write("rabbitmq/advanced.config", broker_ssl_config(cacertfile="ca.crt", certfile="tls/broker.crt",
                                                            keyfile="tls/broker.key", crl_dir=CRL_DIR))
    kit.write("rabbitmq/enabled_plugins", RABBITMQ_PLUGINS)
    kit.yaml("prometheus/prometheus.yml", server_scrape_doc(project), header=_SCRAPE_NOTE)
    for role in ("aggregator", "coordinator"):
        kit.write(f"start-{role}.sh", _script(f"the {role}", f"{role} --config {role}.yaml"), executable=True)
    kit.write("start.sh", _START_SERVER, executable=True)
    kit.write("start-broker.sh", _broker_script(project), executable=True)
    k8s.overlay(project, kit, passwords["coordinator"], tokens["coordinator"], crl_file_name(ca.cert.subject))
    kit.write("README.md", _server_readme(project))
    return folder


SERVER_ROLES = ("coordinator", "aggregator", "broker")


def server_certificate(project: Project, ca: Authority, role: str) -> tuple[bytes, bytes]:
    """(certificate, key) of one of the server's TLS ports, naming its public names and in-cluster Service."""
    svc = k8s.IN_CLUSTER[role]
    return ca.server(f"{project.name} {role}", [project.host, *project.sans, svc, f"{svc}.{k8s.K8S_NAMESPACE}.svc",
                                                f"{svc}.{k8s.K8S_NAMESPACE}.svc.cluster.local"])


def _script(what: str, args: str) -> str:
    """A start script that runs from any folder (the kit's paths are relative to the kit)."""
    return (
        "#!/bin/sh\n"
        f"# Start {what} from this kit (from any folder: the kit's paths are relative to it).\n"
        "# FEDBROKER overrides the command, e.g. FEDBROKER='python -m fedbroker'.\n"
        "set -eu\n"
        'cd "$(dirname "$0")"\n'
        "mkdir -p state\n"
        f'exec ${{FEDBROKER:-fedbroker}} {args} "$@"\n'
    )


def _broker_script(project: Project) -> str:
    """The host broker's start script: the kit's config files, and a node of its own (name, distribution port on
    127.0.0.1), so that it runs beside the host's default RabbitMQ node and `broker sync --node` reaches it."""
    return (
        "#!/bin/sh\n"
        "# Start this kit's RabbitMQ (3.10 or later) from this kit, from any folder, beside any other RabbitMQ node\n"
        f"# on this host: its own node name {broker_node(project)} (the `fedbroker broker sync` line that\n"
        "# `fedbroker provision` prints names it with --node), its Erlang distribution on\n"
        f"# 127.0.0.1:{project.broker_dist_port} (server.broker_dist_port), the config files of rabbitmq/, its data\n"
        "# and logs in state/rabbitmq (or RABBITMQ_MNESIA_BASE, RABBITMQ_LOG_BASE). RABBITMQ_SERVER overrides the\n"
        "# command: Debian's /usr/sbin/rabbitmq-server changes folder and user, run the script it wraps,\n"
        "# RABBITMQ_SERVER=/usr/lib/rabbitmq/bin/rabbitmq-server. Run `broker sync` as the same user (its cookie).\n"
        "set -eu\n"
        'cd "$(dirname "$0")"\n'
        'kit="$(pwd)"\n'
        f"export RABBITMQ_NODENAME='{broker_node(project)}' RABBITMQ_DIST_PORT={project.broker_dist_port}\n"
        "export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}'\n"
        'export RABBITMQ_CONFIG_FILE="$kit/rabbitmq/rabbitmq.conf" '
        'RABBITMQ_ADVANCED_CONFIG_FILE="$kit/rabbitmq/advanced.config" '
        'RABBITMQ_ENABLED_PLUGINS_FILE="$kit/rabbitmq/enabled_plugins"\n'
        'export RABBITMQ_MNESIA_BASE="${RABBITMQ_MNESIA_BASE:-$kit/state/rabbitmq/mnesia}" '
        'RABBITMQ_LOG_BASE="${RABBITMQ_LOG_BASE:-$kit/state/rabbitmq/log}"\n'
        "mkdir -p state/rabbitmq\n"
        'exec "${RABBITMQ_SERVER:-rabbitmq-server}" "$@"\n'
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


_SCRAPE_NOTE = ("# A Prometheus on this host scrapes this kit's processes (`prometheus --config.file=prometheus.yml`);\n"
                "# the alert rules are deploy/prometheus/alerts.yml in fedbroker's source.\n")


def site_kit(project: Project, folder: Path, ca: Authority, site: Site, token: str, password: str) -> Path:
    """A data owner's kit: its token, broker login, client certificate, worker.yaml and start script."""
    kit = KitFolder(folder)
    kit.write("ca.crt", ca.cert_pem())
    kit.write("secrets/token", token + "\n", secret=True)
    kit.write("secrets/broker-url", broker_url(broker_user(project, site.name), password, project.host, project.broker_port) + "\n",
              secret=True)
    cert, key = ca.client(site.name)
    kit.write("tls/client.crt", cert)
    kit.write("tls/client.key", key, secret=True)
    doc = worker_doc(project, site)
    metrics = doc["worker"]
    kit.yaml("worker.yaml", doc, header=f"# The worker of {site.name} (start.sh). Your data, your DP policy: edit the worker section.\n"
              f"# Keep state/ledger.json (your privacy ledger) across restarts and upgrades.\n"
              + (unfilled.HEADER if unfilled.names_no_data(site.worker) else ""))
    kit.yaml("prometheus/prometheus.yml", site_scrape_doc(project, metrics, site.name), header=_SCRAPE_NOTE)
    kit.write("start.sh", _script(f"the worker of {site.name}", "worker --config worker.yaml"), executable=True)
    kit.write("README.md", (
        f"# {site.name}: your kit for the {project.name} federation\n\n"
        f"1. {_INSTALL} Then edit the `worker` section of `worker.yaml`: your data "
        f"set and your differential-privacy policy (`dp`), which no job can override."
        + (f" Until you name your data there, `worker.yaml` says `{unfilled.FILL_IN}` in its place and the worker "
           f"refuses to start." if unfilled.names_no_data(site.worker) else "") + "\n"
        f"2. Start it: `./start.sh` (or `FEDBROKER='python -m fedbroker' ./start.sh`). It connects out to the "
        f"broker at {target(project.host, project.broker_port)} (AMQPS) and the aggregation service at "
        f"{target(project.host, project.aggregator_port)} (gRPC over TLS), both verified against `ca.crt`; "
        f"nothing connects in.\n"
        f"3. Keep `secrets/` and `tls/client.key` private (0600): `secrets/token` and `tls/client.*` are your "
        f"identity, `secrets/broker-url` your broker login. Keep `state/ledger.json`: it records the privacy "
        f"you have spent.\n"
        f"4. See what you spent and shared: `fedbroker ledger --config worker.yaml` in this folder (or `fedbroker "
        f"ledger --kit PATH` from anywhere; `--json` for a document): ε in total, per job and per release, your "
        f"budget left, what left this site for which job and when, beside the coordinator's record of you (at "
        f"{target(project.host, project.coordinator_port)}, asked with your token and certificate: a site reads "
        f"its own record and nothing else there). The worker serves Prometheus metrics (its ε, budget, tasks) on "
        f"http://{metrics['metrics_addr']}:{metrics['metrics_port']}/metrics for your own Prometheus "
        f"(`metrics_addr` and `metrics_port` in worker.yaml; 127.0.0.1 keeps it off the network); "
        f"`prometheus/prometheus.yml` is a Prometheus config that scrapes it.\n"))
    return folder


def scientist_kit(project: Project, folder: Path, ca: Authority, name: str, token: str) -> Path:
    """A data scientist's kit: its token, client certificate and the CLI's config."""
    kit = KitFolder(folder)
    kit.write("ca.crt", ca.cert_pem())
    kit.write("secrets/token", token + "\n", secret=True)
    cert, key = ca.client(name)
    kit.write("tls/client.crt", cert)
    kit.write("tls/client.key", key, secret=True)
    kit.yaml("fedbroker.yaml", scientist_doc(project), header="# The CLI's config: run `fedbroker <command> --config fedbroker.yaml` in this folder.\n")
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
        f"{target(project.host, project.coordinator_port)}`), give the CLI this kit's files by their absolute "
        f"paths: `FEDBROKER__CLIENT__TOKEN_FILE` (`secrets/token`), `FEDBROKER__CLIENT__CA_FILE` (`ca.crt`), "
        f"`FEDBROKER__CLIENT__CERT_FILE` (`tls/client.crt`) and `FEDBROKER__CLIENT__KEY_FILE` "
        f"(`tls/client.key`). The coordinator speaks mutual TLS only: a call without the CA and the client "
        f"certificate fails with `UNAVAILABLE` (`Socket closed`), whatever the token.\n"))
    return folder


def _server_readme(project: Project) -> str:
    return (
        f"# The {project.name} server kit\n\n"
        f"Sites reach this server at `{project.host}`: AMQPS on {project.broker_port}, the aggregation service "
        f"on {project.aggregator_port} and the coordinator on {project.coordinator_port} (gRPC over TLS). "
        f"Open those three ports, nothing else.\n\n"
        f"## On Kubernetes\n\n"
        f"`kubectl kustomize .` renders the server side (broker, aggregation service, coordinator) with TLS on "
        f"and a LoadBalancer Service per port; `kubectl apply -k .` applies it. Point `{project.host}` at the "
        f"balancers' addresses (`kubectl -n {k8s.K8S_NAMESPACE} get svc -l app.kubernetes.io/part-of=fedbroker`).\n\n"
        f"## On a host\n\n"
        f"1. `./start-broker.sh` starts RabbitMQ 3.10 or later (the Kubernetes base runs 4.1) with "
        f"`rabbitmq/rabbitmq.conf`, `rabbitmq/advanced.config` and `rabbitmq/enabled_plugins`, in this folder (they "
        f"name this kit's `ca.crt`, `tls/broker.*`, `rabbitmq/definitions.json` and the CRL folder `rabbitmq/crls` "
        f"relative to it), as its own node `{broker_node(project)}` beside any other RabbitMQ on the host: AMQPS on "
        f"{project.listen}:{project.broker_port} with mutual TLS and the CRL checked on every handshake, its "
        f"management UI and metrics on {project.metrics_addr} only.\n"
        f"2. `./start.sh` starts the aggregation service and the coordinator (or `start-aggregator.sh` and "
        f"`start-coordinator.sh` apart), gRPC on {project.listen}, metrics on {project.metrics_addr} "
        f"(`aggregator.metrics_port`, `coordinator.metrics_port`). State lives in `state/`.\n"
        f"3. `prometheus/prometheus.yml` scrapes all three from this host.\n\n"
        f"`crl.pem` (beside `ca.crt`, and its copy in `rabbitmq/crls/`) is the CA's revocation list; `tokens/*.yaml`, "
        f"`crl.pem` and `rabbitmq/definitions.json` change in place (each file whole) when the operator adds, "
        f"renews, revokes or rotates a participant (`fedbroker provision add|renew|revoke|rotate-token`): the "
        f"services follow them; the broker's users follow with the `fedbroker broker sync` line the command "
        f"prints.\n\n"
        f"Keep `tls/*.key`, `tokens/`, `secrets/` and `rabbitmq/definitions.json` private (0600). The CA's key "
        f"is not here: it stays with whoever provisioned the project.\n")
